"""Bad inputs and faults, tried as a new user would, each classed by what the user saw.

    python -m lab.scripts.audit_bad_inputs --jobs 2 --out lab/notes/bad-inputs.md

Every case of ``lab/bad_inputs/*.yaml`` is one bash command run in a folder of its own:
the ``longnet`` command, a script, or a Python snippet using the API. ``$REPO`` is this
checkout, ``$FIX`` a folder of shared fixtures made once by ``lab/bad_inputs/fixtures.sh``
(a finished smoke run, a saved model; cases copy what they change). A case says what it
expects:

- ``expect: error``: a non-zero exit whose message matches ``says`` (a regular expression,
  case-insensitive) in at most ``max_lines`` lines of stderr (default 12) and, for the CLI and
  the scripts, no Python traceback. A snippet marked ``api: true`` may end in a traceback (that
  is how Python reports an exception) but the exception must be raised by longnet's own code,
  not deep inside torch or another library.
- ``expect: ok``: exit status 0.

Either way ``then`` (optional, a bash command run afterwards in the same folder) must exit 0: it
checks what must hold after the case (the result is right, a folder was not damaged).

Classes: ``clear error`` and ``correct`` are good; ``accepted`` (an error was expected, the
command exited 0), ``traceback``, ``unclear`` (the message does not say ``says``, is too long,
or comes from inside a library), ``failed`` (ok was expected), ``damaged`` (``then`` failed)
and ``hang`` (``--timeout`` passed) are not. The script prints a table, writes it to ``--out``
with the machine and the command, and exits 1 when any case is not good.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

import longnet

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(longnet.__file__).resolve().parent
CASES = ROOT / "lab" / "bad_inputs"
GOOD = ("clear error", "correct")
TRACEBACK = "Traceback (most recent call last)"
FRAME = re.compile(r'^(\[rank\d+\]: )?\s*File "(?P<file>[^"]+)", line \d+')
"""A traceback frame's line (torch prefixes those of a process in a process group with its
rank)."""


@dataclass(frozen=True)
class Case:
    """One command and what it should do (the fields of a YAML entry)."""

    id: str
    area: str
    what: str
    run: str
    expect: str
    says: str = ""
    then: str = ""
    api: bool = False
    max_lines: int = 12

    def __post_init__(self) -> None:
        if self.expect not in ("error", "ok"):
            raise ValueError(f"case {self.id}: expect must be 'error' or 'ok', not "
                             f"{self.expect!r}")
        if not isinstance(self.says, str):
            raise ValueError(f"case {self.id}: says must be a string (a regex), got "
                             f"{self.says!r}; quote it in the YAML")
        if self.expect == "error" and not self.says:
            raise ValueError(f"case {self.id}: an expected error needs `says` (a regex of what "
                             "the message must name)")


@dataclass
class Outcome:
    """What one case did."""

    case: Case
    verdict: str
    exit_status: int | None
    lines: int
    message: str
    seconds: float
    why: str = ""
    output: str = field(default="", repr=False)

    @property
    def good(self) -> bool:
        return self.verdict in GOOD


def load_cases(folder: Path = CASES) -> list[Case]:
    """Every case of ``folder/*.yaml``, in file then entry order; ids must be unique."""
    cases: list[Case] = []
    for path in sorted(folder.glob("*.yaml")):
        try:
            entries = yaml.safe_load(path.read_text()) or []
        except yaml.YAMLError as err:
            raise SystemExit(f"{path}: not valid YAML ({err}); quote commands with `run: |`") \
                from None
        for entry in entries:
            try:
                cases.append(Case(**entry))
            except TypeError as err:
                raise ValueError(f"{path.name}: entry {entry.get('id', entry)!r}: {err}") from err
    seen: set[str] = set()
    for case in cases:
        if case.id in seen:
            raise ValueError(f"case id {case.id!r} is used twice")
        seen.add(case.id)
    return cases


def error_message(stderr: str) -> str:
    """The line a user reads first: the last line of a traceback, else the last non-empty
    line of stderr (the CLI's own reports end with the fix)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if not lines:
        return ""
    if TRACEBACK in stderr:
        return lines[-1]
    errors = [line for line in lines  # "error: ...", "longnet: error: ...", "UsageError: ..."
              if re.match(r"([\w.-]+: )?(usage ?|configuration )?error\b", line, re.I)]
    return errors[-1] if errors else lines[-1]


def raised_in(stderr: str) -> str:
    """The file of the innermost frame of the last traceback in ``stderr`` ('' if none)."""
    files = [m["file"] for m in map(FRAME.match, stderr.splitlines()) if m]
    return files[-1] if files else ""


def own_code(path: str) -> bool:
    """Whether a traceback frame is in the longnet package the cases run (this Python's)."""
    return bool(path) and Path(path).resolve().is_relative_to(PACKAGE)


def stderr_lines(stderr: str) -> int:
    """The non-empty lines of ``stderr``: what a case's ``max_lines`` bounds."""
    return len([line for line in stderr.splitlines() if line.strip()])


def classify(case: Case, status: int | None, stdout: str, stderr: str,
             then_status: int | None) -> tuple[str, str]:
    """The verdict on one finished case and, for a bad one, why (see the module docstring)."""
    if status is None:
        return "hang", "timed out"
    if case.expect == "ok":
        if status != 0:
            return "failed", f"exit {status}"
    elif status == 0:
        return "accepted", "exit 0 where an error was expected"
    elif TRACEBACK in stderr and not case.api:
        return "traceback", "a Python traceback"
    elif case.api and TRACEBACK in stderr and not own_code(raised_in(stderr)):
        return "unclear", f"raised inside {raised_in(stderr)}"
    elif not re.search(case.says, stdout + stderr, re.I | re.S):
        return "unclear", f"does not say /{case.says}/"
    else:
        lines = stderr_lines(stderr)
        if lines > case.max_lines and not case.api:
            return "unclear", f"{lines} lines of stderr (at most {case.max_lines})"
    if then_status not in (None, 0):
        return "damaged", f"`then` exited {then_status}"
    return ("clear error" if case.expect == "error" else "correct"), ""


def run_case(case: Case, workdir: Path, env: dict[str, str], timeout: float) -> Outcome:
    """Run one case in ``workdir/<id>`` and class it."""
    folder = workdir / case.id
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    start = time.perf_counter()
    try:
        done = subprocess.run(["bash", "-c", case.run], cwd=folder, env=env, text=True,
                              capture_output=True, timeout=timeout, errors="replace")
        status, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as err:
        status, stdout, stderr = None, _text(err.stdout), _text(err.stderr)
    then_status = None
    if case.then and status is not None:
        then = subprocess.run(["bash", "-c", case.then], cwd=folder, env=env, text=True,
                              capture_output=True, timeout=timeout, errors="replace")
        then_status = then.returncode
        stderr += then.stdout + then.stderr if then.returncode else ""
    verdict, why = classify(case, status, stdout, stderr, then_status)
    return Outcome(case, verdict, status, stderr_lines(stderr), error_message(stderr),
                   time.perf_counter() - start, why, stdout + stderr)


def _text(data: bytes | str | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def case_env(fixtures: Path) -> dict[str, str]:
    """The environment of every case: this Python's ``bin`` first on ``PATH`` (its ``longnet``
    command), ``REPO`` and ``FIX``; no data download."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(REPO=str(ROOT), FIX=str(fixtures), HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def make_fixtures(fixtures: Path, env: dict[str, str]) -> None:
    """Run ``fixtures.sh`` in ``fixtures`` (only when some case uses ``$FIX``), unless a kept
    ``--workdir`` already holds them."""
    made = fixtures / "made"
    if made.exists():
        return
    shutil.rmtree(fixtures, ignore_errors=True)
    fixtures.mkdir(parents=True)
    done = subprocess.run(["bash", str(CASES / "fixtures.sh")], cwd=fixtures, env=env,
                          text=True, capture_output=True)
    if done.returncode:
        raise SystemExit(f"fixtures.sh failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    made.touch()


def table(outcomes: list[Outcome]) -> str:
    header = "| case | area | what | expected | verdict | exit | stderr lines | first line read |"
    rows = [header, "|" + "---|" * 8]
    for o in outcomes:
        message = o.message.replace("|", "\\|")[:160]
        verdict = o.verdict if o.good else f"**{o.verdict}** ({o.why})"
        rows.append(f"| `{o.case.id}` | {o.case.area} | {o.case.what} | {o.case.expect} | "
                    f"{verdict} | {o.exit_status} | {o.lines} | {message} |")
    return "\n".join(rows)


def summary(outcomes: list[Outcome]) -> str:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.verdict] = counts.get(o.verdict, 0) + 1
    return ", ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items()))


def report(outcomes: list[Outcome], command: str, seconds: float) -> str:
    from lab.bench import common

    return "\n".join([
        "# Bad inputs and faults, as a new user meets them", "",
        "Written by `lab/scripts/audit_bad_inputs.py` (what each class means: its docstring; the "
        "cases: `lab/bad_inputs/*.yaml`). Re-run it after changing what a command accepts "
        "or says.", "",
        f"- command: `{command}`",
        f"- machine: {common.machine()}; {common.commit_version(ROOT)}; "
        f"{time.strftime('%Y-%m-%d')}; {seconds / 60:.1f} min",
        f"- {len(outcomes)} cases: {summary(outcomes)}", "",
        table(outcomes), "",
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=CASES, help="folder of *.yaml cases")
    parser.add_argument("--only", default="", help="regex: run the cases whose id matches")
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    parser.add_argument("--out", type=Path, help="write the report (markdown) here")
    parser.add_argument("--workdir", type=Path, help="keep the case folders here")
    parser.add_argument("--show", action="store_true", help="print the output of bad cases")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.timeout <= 0:
        parser.error("--jobs must be at least 1 and --timeout positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = [c for c in load_cases(args.cases) if re.search(args.only, c.id)]
    if not cases:
        raise SystemExit(f"no case id matches --only {args.only!r}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bad-inputs-") as scratch:
        workdir = args.workdir or Path(scratch)
        env = case_env(workdir / "_fixtures")
        if any("$FIX" in case.run + case.then for case in cases):
            make_fixtures(workdir / "_fixtures", env)
        print(f"{len(cases)} cases, {args.jobs} at a time, in {workdir}", flush=True)
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(run_case, c, workdir / "cases", env, args.timeout)
                       for c in cases]
            outcomes = []
            for n, future in enumerate(futures, 1):
                o = future.result()
                outcomes.append(o)
                print(f"[{n}/{len(cases)}] {o.case.id}: {o.verdict} {o.why} "
                      f"({o.seconds:.0f} s)", flush=True)
                if args.show and not o.good:
                    print("    " + o.output[-2000:].replace("\n", "\n    "), flush=True)
    command = "python -m lab.scripts.audit_bad_inputs " + " ".join(sys.argv[1:] if argv is None
                                                                else argv)
    text = report(outcomes, command.strip(), time.perf_counter() - start)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if all(o.good for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
