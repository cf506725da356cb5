"""atheris target: the OpenAI JSON converters against hostile clients and runtimes.

Half of the inputs are request bodies for every ``parse_*`` converter
(random JSON, wrong types, huge strings, deep nesting, bytes that are not
JSON): each must end in a request that survives the wire and converts back
for a runtime, or in an InvalidRequestError (400 with an OpenAI error body).
The other half are a runtime's answers for the /v1/completions conversion and
the SSE parser: they convert or end in an UpstreamError (502). Anything else
that escapes is a finding.

Run it with ``tools/fuzz/run openai`` or directly:
``python tools/fuzz/fuzz_openai.py -max_total_time=300 CORPUS_DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports(include=["protocol", "tools"]):
    from tools.fuzz.drivers import AtherisSource, check_openai_body, check_runtime_answer, json_body


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    mode = fdp.ConsumeIntInRange(0, 3)
    if mode == 0:
        # Raw bytes: libFuzzer's own mutations, dictionary-guided.
        body = fdp.ConsumeBytes(fdp.remaining_bytes())
        check_openai_body(body)
        check_runtime_answer(body)
    elif mode == 1:
        check_runtime_answer(fdp.ConsumeBytes(fdp.remaining_bytes()))
    else:
        check_openai_body(json_body(AtherisSource(fdp)))


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
