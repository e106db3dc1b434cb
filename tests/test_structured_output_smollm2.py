"""Structured outputs on the real SmolLM2-135M-Instruct (skipped when absent): 20 of 20 chat
answers with a json_schema response_format parse and validate against the schema."""
from __future__ import annotations

import concurrent.futures
import json
import os

import openai
import pytest

from server_utils import RemoteServer

SMOLLM2 = "/tmp/smollm2/smollm2-135m-instruct-hf"
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 40},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3}},
          "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
PEOPLE = ["a baker", "a pilot", "a nurse", "a farmer", "a poet", "a chess player", "a chef", "a sailor",
          "a teacher", "a painter", "a miner", "a judge", "a dancer", "a monk", "a doctor", "a student",
          "a banker", "a gardener", "a singer", "a carpenter"]


def validate(obj: dict) -> None:
    try:
        import jsonschema
    except ImportError:  # check by hand
        assert set(obj) == set(SCHEMA["required"]) and isinstance(obj["name"], str) and 1 <= len(obj["name"]) <= 40
        assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120 and isinstance(obj["city"], str)
        assert isinstance(obj["hobbies"], list) and len(obj["hobbies"]) <= 3
        assert all(isinstance(h, str) and len(h) <= 30 for h in obj["hobbies"])
    else:
        jsonschema.validate(obj, SCHEMA)


@pytest.mark.skipif(not os.path.isdir(SMOLLM2), reason=f"SmolLM2 not at {SMOLLM2} (../shared/tools/get_smollm2.py)")
def test_smollm2_json_schema_20_of_20(tmp_path):
    args = ("--served-model-name", "smol", "--max-model-len", "1024", "--kv-cache-memory", "256MiB")
    with RemoteServer(SMOLLM2, args, log_path=str(tmp_path / "server.log")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)

        def ask(i: int) -> tuple[str, str]:
            r = client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": f"Describe {PEOPLE[i]} as a JSON object."}],
                max_tokens=200, temperature=0.7, seed=i,
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
            return r.choices[0].message.content, r.choices[0].finish_reason

        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(ask, range(20)))
    assert srv.returncode == 0
    for text, finish in answers:
        assert finish == "stop", text
        validate(json.loads(text))
