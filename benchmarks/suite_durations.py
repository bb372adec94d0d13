"""Where the test suite's time goes: per file and per kind of work, from pytest's JUnit XML.

    python -m pytest --junitxml=/tmp/suite.xml                  # or -m "not slow"
    python benchmarks/suite_durations.py /tmp/suite.xml [--before /tmp/before.xml] [--json out.json]

A test's time is its setup + call + teardown (pytest's JUnit default), so a module fixture's
work (a training run shared by a file's tests) counts for the test that first asked for it.
Kinds, by what a test runs (read from its source):

* ``train subprocess``: ``python -m meshfold ...`` or an example script in a process of its own,
  which imports torch and starts its own ranks;
* ``spawned world``: functions run on gloo ranks (``worlds(n)``, ``spawn``, ``World``);
* ``dry run``: ``meshfold dryrun``'s fake step, one process per rank;
* ``hypothesis``: a property (``@given``) run in this process;
* ``LocalTensorMode``: folds of 16 to 64 ranks simulated in this process;
* ``Triton interpreter``: the kernels interpreted in a child process;
* ``one process``: everything else (pure Python, single-device torch).

``--before`` adds the columns of an earlier run of the same suite (tests matched by file).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("train subprocess", "spawned world", "dry run", "hypothesis", "LocalTensorMode", "Triton interpreter",
         "one process")
BY_FILE = {"test_train.py": "train subprocess", "test_run_lifecycle.py": "train subprocess",
           "test_examples.py": "train subprocess", "test_plan_vs_dryrun.py": "dry run",
           "test_large_folds.py": "LocalTensorMode", "test_simulated.py": "LocalTensorMode",
           "test_kernels_interpret.py": "Triton interpreter"}
SIGNS = [("train subprocess", re.compile(r"\bmeshfold\(\s*\"train\"|subprocess\.|run_cli\(|Popen\(")),
         ("dry run", re.compile(r"\bdry_run\(|_check_same_step|_check_rank\(")),
         ("spawned world", re.compile(r"\bworlds\b|\bspawn\(|\bWorld\(")),
         ("hypothesis", re.compile(r"^@given\(", re.M))]


def read_junit(path: str) -> list[dict]:
    """[{file, name, seconds, outcome}] of every test case in a JUnit XML file."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        file = next((f"{m}.py" for m in module if m.startswith("test_")), module[-1])
        outcome = "skipped" if case.find("skipped") is not None else \
            "failed" if case.find("failure") is not None or case.find("error") is not None else "passed"
        out.append({"file": file, "name": case.get("name"), "seconds": float(case.get("time", 0)),
                    "outcome": outcome})
    return out


def _sources(file: str) -> dict[str, str]:
    """{test function name: its source and that of the file's fixtures it takes} of the test file."""
    path = next((ROOT / "tests").rglob(file), None)  # tests/<package>/<file>
    if path is None:
        return {}
    text = path.read_text()
    functions = {node.name: node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.FunctionDef)}
    return {name: "\n".join([*(f"@{ast.unparse(d)}" for d in node.decorator_list),
                             *(ast.get_source_segment(text, functions[f])
                               for f in [name, *(a.arg for a in node.args.args)] if f in functions)])
            for name, node in functions.items() if name.startswith("test_")}


def kind_of(file: str, name: str, sources: dict[str, dict[str, str]]) -> str:
    if file in BY_FILE:
        return BY_FILE[file]
    source = sources.setdefault(file, _sources(file)).get(name.split("[")[0], "")
    return next((kind for kind, sign in SIGNS if sign.search(source)), "one process")


def tables(cases: list[dict]) -> tuple[dict, dict]:
    """({file: (seconds, tests)}, {kind: (seconds, tests)})."""
    sources: dict = {}
    per_file, per_kind = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0])
    for c in cases:
        for table, key in ((per_file, c["file"]), (per_kind, kind_of(c["file"], c["name"], sources))):
            table[key][0] += c["seconds"]
            table[key][1] += 1
    return dict(per_file), dict(per_kind)


def markdown(cases: list[dict], before: list[dict] | None = None) -> str:
    files, kinds = tables(cases)
    old_files, old_kinds = tables(before) if before else ({}, {})
    total = sum(c["seconds"] for c in cases)
    head = "| {} | s | tests |" + (" s before | tests before |" if before else "")
    rule = "|---|---:|---:|" + ("---:|---:|" if before else "")

    def rows(table, old, keys):
        lines = []
        for k in keys:
            s, n = table.get(k, (0.0, 0))
            line = f"| {k} | {s:.0f} | {n} |"
            if before:
                s0, n0 = old.get(k, (0.0, 0))
                line += f" {s0:.0f} | {n0} |"
            lines.append(line)
        return lines

    file_keys = sorted(set(files) | set(old_files), key=lambda k: -max(files.get(k, (0,))[0], old_files.get(k, (0,))[0]))
    kind_keys = [k for k in KINDS if k in kinds or k in old_kinds]
    out = [head.format("file"), rule, *rows(files, old_files, file_keys), "",
           head.format("kind"), rule, *rows(kinds, old_kinds, kind_keys), ""]
    line = f"total {total:.0f} s over {len(cases)} tests"
    if before:
        line += f" (before: {sum(c['seconds'] for c in before):.0f} s over {len(before)} tests)"
    outcomes = defaultdict(int)
    for c in cases:
        outcomes[c["outcome"]] += 1
    return "\n".join(out + [line + "; " + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items()))])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", help="pytest --junitxml file")
    parser.add_argument("--before", help="an earlier run's --junitxml file, for before/after columns")
    parser.add_argument("--json", help="also write the per-test rows here")
    args = parser.parse_args(argv)
    cases = read_junit(args.junit)
    before = read_junit(args.before) if args.before else None
    print(markdown(cases, before))
    if args.json:
        sources: dict = {}
        Path(args.json).write_text(json.dumps([{**c, "kind": kind_of(c["file"], c["name"], sources)}
                                               for c in cases], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
