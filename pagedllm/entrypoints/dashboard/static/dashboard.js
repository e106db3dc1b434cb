// pagedllm dashboard: reads /dashboard/api/stream (server-sent events over fetch, so that the API key
// travels in the Authorization header and never in a URL) and draws the block pool, the queues and charts.
"use strict";
(() => {
  const FREE = 0, CACHED = 1, USED = 2, SHARED = 3;
  const MAX_CELLS = 4096;               // above this many blocks in view, one cell stands for several
  const HISTORY_S = 300;
  const $ = (id) => document.getElementById(id);
  const css = getComputedStyle(document.documentElement);
  const COLORS = { free: css.getPropertyValue("--free").trim() || "#2a313a",
                   cached: css.getPropertyValue("--cached").trim() || "#5b6b7c",
                   shared: css.getPropertyValue("--shared").trim() || "#ffd166" };

  const view = { start: 0, span: 0 };   // blocks [start, start + span) are drawn
  const st = { facts: null, snap: null, state: null, owner: null, refs: null, reqs: [], hover: -1,
               history: [], counts: null, cells: null, connected: false };

  // ---- the key ---------------------------------------------------------------------------------
  let apiKey = sessionStorage.getItem("pagedllm-api-key") || "";
  $("keyform").addEventListener("submit", (e) => {
    e.preventDefault();
    apiKey = $("key").value.trim();
    sessionStorage.setItem("pagedllm-api-key", apiKey);
    $("keyform").hidden = true;
    connect();
  });

  function setStatus(text, cls) {
    const s = $("status");
    s.textContent = text;
    s.className = "status " + (cls || "");
  }

  // ---- the stream --------------------------------------------------------------------------------
  let retryTimer = null;
  async function connect() {
    clearTimeout(retryTimer);
    let resp;
    try {
      resp = await fetch("/dashboard/api/stream", { headers: apiKey ? { Authorization: "Bearer " + apiKey } : {},
                                                    cache: "no-store" });
    } catch (err) {
      return lost();
    }
    if (resp.status === 401) {
      $("keyform").hidden = false;
      $("keyerror").textContent = apiKey ? "that key was refused" : "";
      setStatus("API key needed", "wait");
      return;
    }
    if (!resp.ok || !resp.body) return lost();
    st.connected = true;
    setStatus("live", "");
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const raw = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          let event = "message", data = "";
          for (const line of raw.split("\n")) {
            if (line.startsWith("event: ")) event = line.slice(7);
            else if (line.startsWith("data: ")) data += line.slice(6);
          }
          if (data) onEvent(event, JSON.parse(data));
        }
      }
    } catch (err) { /* the connection broke: fall through */ }
    lost();
  }

  function lost() {
    st.connected = false;
    setStatus("server stopped or unreachable since " + new Date().toLocaleTimeString() + " — retrying", "down");
    retryTimer = setTimeout(connect, 2000);
  }

  function onEvent(event, data) {
    if (event === "info") showFacts(data);
    else if (event === "history") { st.history = data; drawCharts(); }
    else if (event === "sample") {
      st.history.push(data);
      while (st.history.length && data.time - st.history[0].time > HISTORY_S) st.history.shift();
      drawCharts();
    } else if (event === "pool") onPool(data);
  }

  function showFacts(f) {
    st.facts = f;
    $("facts").textContent = `${f.model} · ${f.architecture} · ${f.dtype} on ${f.device}` +
      (f.tensor_parallel_size > 1 ? ` (TP ${f.tensor_parallel_size})` : "") +
      ` · ${f.num_blocks.toLocaleString()} KV blocks × ${f.block_size} tokens · max_model_len ${f.max_model_len}` +
      ` · max concurrency ${f.max_concurrency.toFixed(2)} · prefix caching ${f.prefix_caching ? "on" : "off"}`;
  }

  // ---- the pool --------------------------------------------------------------------------------
  function hue(id) {
    let h = 2166136261;
    for (let i = 0; i < id.length; i++) { h ^= id.charCodeAt(i); h = Math.imul(h, 16777619); }
    return (h >>> 0) % 360;
  }
  const reqColor = (r, alpha) => `hsla(${hue(r.id)}, 70%, 58%, ${alpha === undefined ? 1 : alpha})`;

  function onPool(snap) {
    const n = snap.num_blocks;
    const state = new Uint8Array(n), owner = new Int32Array(n).fill(-1), refs = new Uint16Array(n);
    const bits = atob(snap.cached_bitmap);
    for (let i = 0; i < n; i++) if ((bits.charCodeAt(i >> 3) >> (i & 7)) & 1) state[i] = CACHED;
    const reqs = snap.running.map((r) => ({ ...r, queue: "running" }))
      .concat(snap.waiting.map((r) => ({ ...r, queue: "waiting" })));
    reqs.forEach((r, i) => {
      for (const b of r.blocks) { refs[b]++; if (owner[b] < 0) owner[b] = i; }
    });
    const counts = { free: 0, used: 0, shared: 0, cached: 0 };
    for (let b = 0; b < n; b++) {
      if (refs[b] > 1) state[b] = SHARED;
      else if (refs[b] === 1) state[b] = USED;
      if (refs[b] > 0) counts.used++;
      if (refs[b] > 1) counts.shared++;
      if (state[b] === CACHED) counts.cached++;
    }
    counts.free = n - counts.used - counts.cached;
    Object.assign(st, { snap, state, owner, refs, reqs, counts });
    if (view.span === 0 || view.span > n) { view.start = 0; view.span = n; }
    $("count-free").textContent = counts.free;
    $("count-used").textContent = counts.used;
    $("count-shared").textContent = counts.shared;
    $("count-cached").textContent = counts.cached;
    $("kv-usage").textContent = (100 * snap.stats.kv_cache_usage).toFixed(1) + " %";
    $("poolinfo").textContent = `${n.toLocaleString()} blocks · snapshot ${snap.version} at ` +
      new Date(snap.time * 1000).toLocaleTimeString();
    $("nrunning").textContent = `(${snap.running.length})`;
    $("nwaiting").textContent = `(${snap.waiting.length})`;
    if (st.hover >= 0) {  // keep highlighting the same request across snapshots
      const id = st.hoverId;
      st.hover = reqs.findIndex((r) => r.id === id);
    }
    renderQueue("running", reqs.filter((r) => r.queue === "running"));
    renderQueue("waiting", reqs.filter((r) => r.queue === "waiting"));
    setupZoom();
    drawGrid();
  }

  // Rows are kept per request id and updated in place, so a row under the mouse stays the same element.
  function renderQueue(name, list) {
    const body = $(name).tBodies[0];
    const old = new Map([...body.rows].map((tr) => [tr.dataset.id, tr]));
    list.forEach((r, k) => {
      let tr = old.get(r.id);
      if (tr) old.delete(r.id);
      else {
        tr = document.createElement("tr");
        tr.className = "req";
        tr.dataset.id = r.id;
        tr.style.setProperty("--c", reqColor(r));
        for (let c = 0; c < 6; c++) tr.insertCell();
        tr.cells[5].className = "table";
      }
      tr.dataset.req = st.reqs.indexOf(r);
      tr.classList.toggle("hl", st.reqs.indexOf(r) === st.hover);
      const table = r.blocks.length > 24 ? r.blocks.slice(0, 24).join(" ") + " …" : r.blocks.join(" ");
      const cells = [r.id, r.prompt_tokens, r.output_tokens, r.preemptions, r.blocks.length, `[${table}]`];
      cells.forEach((v, c) => { if (tr.cells[c].textContent !== String(v)) tr.cells[c].textContent = v; });
      tr.cells[5].title = r.blocks.join(" ");
      if (body.rows[k] !== tr) body.insertBefore(tr, body.rows[k] || null);
    });
    for (const tr of old.values()) tr.remove();
  }

  for (const name of ["running", "waiting"]) {
    const body = $(name).tBodies[0];
    body.addEventListener("mouseover", (e) => {
      const tr = e.target.closest("tr.req");
      if (!tr) return;
      st.hover = +tr.dataset.req;
      st.hoverId = tr.dataset.id;
      document.querySelectorAll("tr.req.hl").forEach((x) => x.classList.remove("hl"));
      tr.classList.add("hl");
      drawGrid();
    });
    body.addEventListener("mouseleave", () => {
      st.hover = -1;
      st.hoverId = null;
      document.querySelectorAll("tr.req.hl").forEach((x) => x.classList.remove("hl"));
      drawGrid();
    });
  }

  // ---- zoom ------------------------------------------------------------------------------------
  function setupZoom() {
    const n = st.snap.num_blocks;
    $("zoom").hidden = n <= MAX_CELLS;
    const slider = $("zoom-start");
    slider.max = Math.max(0, n - view.span);
    slider.value = view.start;
    $("zoom-label").textContent = `blocks ${view.start}–${view.start + view.span - 1}` +
      (view.span > MAX_CELLS ? ` (${Math.ceil(view.span / MAX_CELLS)} per cell)` : " (one per cell)");
  }
  $("zoom-in").addEventListener("click", () => { view.span = Math.max(256, Math.floor(view.span / 4)); clampView(); });
  $("zoom-out").addEventListener("click", () => { view.span = Math.min(st.snap.num_blocks, view.span * 4); clampView(); });
  $("zoom-start").addEventListener("input", (e) => { view.start = +e.target.value; clampView(); });
  function clampView() {
    const n = st.snap.num_blocks;
    view.start = Math.max(0, Math.min(view.start, n - view.span));
    setupZoom();
    drawGrid();
  }

  // ---- the grid --------------------------------------------------------------------------------
  function layout(canvas, cells) {
    const w = canvas.width, h = canvas.height;
    let size = Math.max(2, Math.floor(Math.sqrt((w * h) / cells)));
    while (size > 2 && Math.floor(w / size) * Math.floor(h / size) < cells) size--;
    const cols = Math.max(1, Math.floor(w / size));
    return { size, cols };
  }

  function drawGrid() {
    if (!st.snap) return;
    const canvas = $("grid"), ctx = canvas.getContext("2d");
    const per = Math.max(1, Math.ceil(view.span / MAX_CELLS));
    const cells = Math.ceil(view.span / per);
    const { size, cols } = layout(canvas, cells);
    st.cells = { per, size, cols, start: view.start };
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const hl = st.hover;
    const mask = new Uint8Array(hl >= 0 ? st.snap.num_blocks : 0);
    if (hl >= 0) for (const b of st.reqs[hl].blocks) mask[b] = 1;
    for (let c = 0; c < cells; c++) {
      const b0 = view.start + c * per, b1 = Math.min(b0 + per, view.start + view.span);
      // the cell shows its most "alive" block: shared > used > cached > free
      let best = b0, mine = false;
      for (let b = b0; b < b1; b++) {
        if (st.state[b] > st.state[best]) best = b;
        if (hl >= 0 && mask[b]) { mine = true; best = b; break; }
      }
      const s = st.state[best];
      let color;
      if (hl >= 0 && mine) color = reqColor(st.reqs[hl]);
      else if (s === SHARED) color = COLORS.shared;
      else if (s === USED) color = reqColor(st.reqs[st.owner[best]]);
      else if (s === CACHED) color = COLORS.cached;
      else color = COLORS.free;
      ctx.globalAlpha = hl >= 0 && !mine ? 0.18 : 1;
      const x = (c % cols) * size, y = Math.floor(c / cols) * size;
      ctx.fillStyle = color;
      ctx.fillRect(x, y, size - (size > 3 ? 1 : 0), size - (size > 3 ? 1 : 0));
    }
    ctx.globalAlpha = 1;
  }

  function cellOf(block) {
    const c = st.cells;
    if (!c || block < c.start || block >= c.start + view.span) return null;
    const i = Math.floor((block - c.start) / c.per);
    return { x: (i % c.cols) * c.size, y: Math.floor(i / c.cols) * c.size, size: c.size };
  }

  $("grid").addEventListener("mousemove", (e) => {
    const c = st.cells;
    if (!c) return;
    const rect = e.target.getBoundingClientRect();
    const sx = e.target.width / rect.width, sy = e.target.height / rect.height;
    const x = Math.floor(((e.clientX - rect.left) * sx) / c.size), y = Math.floor(((e.clientY - rect.top) * sy) / c.size);
    const cell = y * c.cols + x, b0 = c.start + cell * c.per;
    const tip = $("tooltip");
    if (x >= c.cols || b0 >= c.start + view.span) { tip.hidden = true; return; }
    const names = ["free", "cached (evictable)", "in use", "shared"];
    const owners = st.reqs.filter((r) => r.blocks.includes(b0)).map((r) => r.id);
    tip.textContent = c.per > 1 ? `blocks ${b0}–${b0 + c.per - 1}` :
      `block ${b0}: ${names[st.state[b0]]}` + (owners.length ? ` · refs ${st.refs[b0]} · ${owners.join(", ")}` : "");
    tip.style.left = e.clientX + 12 + "px";
    tip.style.top = e.clientY + 12 + "px";
    tip.hidden = false;
  });
  $("grid").addEventListener("mouseleave", () => { $("tooltip").hidden = true; });

  // ---- charts ----------------------------------------------------------------------------------
  function drawChart(id, series, fmt) {
    const canvas = $(id), ctx = canvas.getContext("2d");
    const w = canvas.width, h = canvas.height, pad = 28;
    ctx.clearRect(0, 0, w, h);
    const pts = st.history;
    if (!pts.length) return;
    const t1 = pts[pts.length - 1].time, t0 = t1 - HISTORY_S;
    let ymax = 0;
    for (const s of series) for (const p of pts) { const v = s.get(p); if (v != null && v > ymax) ymax = v; }
    ymax = ymax > 0 ? ymax * 1.1 : 1;
    ctx.strokeStyle = "#333"; ctx.fillStyle = "#8b949e"; ctx.font = "10px sans-serif";
    ctx.beginPath(); ctx.moveTo(pad, 4); ctx.lineTo(pad, h - 14); ctx.lineTo(w - 4, h - 14); ctx.stroke();
    ctx.fillText(fmt(ymax), 2, 12); ctx.fillText("0", 2, h - 14); ctx.fillText("-5 min", pad, h - 2);
    ctx.fillText("now", w - 24, h - 2);
    series.forEach((s, k) => {
      ctx.strokeStyle = s.color; ctx.beginPath();
      let started = false;
      for (const p of pts) {
        const v = s.get(p);
        if (v == null) { started = false; continue; }
        const x = pad + ((p.time - t0) / HISTORY_S) * (w - pad - 4), y = h - 14 - (v / ymax) * (h - 20);
        if (!started) { ctx.moveTo(x, y); started = true; } else ctx.lineTo(x, y);
      }
      ctx.stroke();
      ctx.fillStyle = s.color; ctx.fillText(s.label, pad + 60 + k * 60, 12);
    });
  }

  function drawCharts() {
    const pct = (v) => v.toFixed(0), num = (v) => v.toFixed(v < 10 ? 2 : 0), sec = (v) => v.toFixed(3);
    const q = (key, p) => (x) => (x[key] ? x[key][p] : null);
    drawChart("c-kv", [{ label: "used", color: "#58a6ff", get: (p) => 100 * p.kv_cache_usage }], pct);
    drawChart("c-queue", [{ label: "running", color: "#3fb950", get: (p) => p.num_running },
                          { label: "waiting", color: "#ff6b6b", get: (p) => p.num_waiting }], num);
    drawChart("c-tok", [{ label: "tok/s", color: "#58a6ff", get: (p) => p.output_tokens_per_s }], num);
    const pcts = (key) => [{ label: "p50", color: "#3fb950", get: q(key, "p50") },
                           { label: "p90", color: "#ffd166", get: q(key, "p90") },
                           { label: "p99", color: "#ff6b6b", get: q(key, "p99") }];
    drawChart("c-ttft", pcts("ttft"), sec);
    drawChart("c-itl", pcts("itl"), sec);
    drawChart("c-hit", [{ label: "hits", color: "#d2a8ff", get: (p) => 100 * p.prefix_cache_hit_rate }], pct);
  }

  // For tests and the curious: the page's own reading of the pool.
  window.pagedllmDashboard = {
    counts: () => st.counts, snapshot: () => st.snap, history: () => st.history, connected: () => st.connected, cellOf,
    hoveredBlocks: () => (st.hover >= 0 ? st.reqs[st.hover].blocks.slice() : []),
  };

  connect();
})();
