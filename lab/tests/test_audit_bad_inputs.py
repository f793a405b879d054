"""``lab/scripts/audit_bad_inputs.py``: every case file loads, and the classes it gives a command
are the ones its docstring defines (each class from a command that earns it)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script():
    path = REPO / "lab" / "scripts" / "audit_bad_inputs.py"
    spec = importlib.util.spec_from_file_location("audit_bad_inputs", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_project_cases_load_with_unique_ids():
    cases = _script().load_cases()
    assert len(cases) > 100  # the folder is found: lab/bad_inputs holds a few hundred
    assert len(cases) == len({case.id for case in cases})


CASES = """
- id: clear
  area: t
  what: an error naming the value
  run: python -c "import sys; sys.exit('error - the value 3 is bad, give 4')"
  expect: error
  says: value 3
- id: accepted
  area: t
  what: a bad value taken silently
  run: "true"
  expect: error
  says: anything
- id: traceback
  area: t
  what: a command that dies in a traceback
  run: python -c "raise KeyError('x')"
  expect: error
  says: x
- id: unclear
  area: t
  what: an error that does not name the value
  run: python -c "import sys; sys.exit('something went wrong')"
  expect: error
  says: value 3
- id: api-inside-a-library
  area: t
  what: an exception from inside torch
  api: true
  run: python -c "import torch; torch.zeros(2) @ torch.zeros(3)"
  expect: error
  says: size
- id: api-own
  area: t
  what: an exception of longnet's own checks
  api: true
  run: python -c "from longnet.modeling import LongNetLM; LongNetLM.from_pretrained('nope')"
  expect: error
  says: nope
- id: correct
  area: t
  what: works, and the check holds
  run: echo hi > out.txt
  expect: ok
  then: grep -q hi out.txt
- id: damaged
  area: t
  what: works, but the check fails
  run: echo hi > out.txt
  expect: ok
  then: grep -q bye out.txt
- id: failed
  area: t
  what: should work, fails
  run: exit 3
  expect: ok
- id: hang
  area: t
  what: never ends
  run: sleep 30
  expect: ok
"""


def test_each_class_is_given_to_the_command_that_earns_it(tmp_path, capsys):
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "t.yaml").write_text(textwrap.dedent(CASES))
    out = tmp_path / "report.md"
    status = _script().main(["--cases", str(tmp_path / "cases"), "--timeout", "10",
                             "--out", str(out)])
    assert status == 1  # some cases are bad
    rows = {line.split(" | ")[0].strip("| `"): line.split(" | ")[4]
            for line in out.read_text().splitlines() if line.startswith("| `")}
    assert {case: verdict.split(" (")[0].strip("*") for case, verdict in rows.items()} == {
        "clear": "clear error", "accepted": "accepted", "traceback": "traceback",
        "unclear": "unclear", "api-inside-a-library": "unclear", "api-own": "clear error",
        "correct": "correct", "damaged": "damaged", "failed": "failed", "hang": "hang",
    }
    assert "10 cases" in out.read_text()


def test_a_case_without_what_it_must_say_is_refused(tmp_path):
    (tmp_path / "t.yaml").write_text("- {id: a, area: t, what: w, run: 'true', expect: error}")
    with pytest.raises(ValueError, match="needs `says`"):
        _script().load_cases(tmp_path)


def test_the_innermost_frame_is_read_from_a_traceback_with_rank_prefixes():
    stderr = ('[rank0]: Traceback (most recent call last):\n'
              '[rank0]:   File "<string>", line 7, in <module>\n'
              '[rank0]:   File "/x/longnet/attention/transport.py", line 34, in f\n'
              '[rank0]: ValueError: one per branch\n')
    assert _script().raised_in(stderr) == "/x/longnet/attention/transport.py"
