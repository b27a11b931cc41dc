"""``bench/tree_ab.py``, the harness of the A/B scripts over source trees (``backward_tree_ab.py``,
``forward_config_ab.py``, ``softcap_ab.py``): each round runs one process per tree with that tree first on the import
path, in the trees' order and reversed every other round, and collects the JSON lines the processes print."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"

# A child that reports which tree it imported its module from, in the form the A/B scripts' children print.
CHILD = """
import json, sys
import probe
label = sys.argv[sys.argv.index("--child") + 1]
print("not a row")
print(json.dumps({"tree": label, "imported": probe.TREE, "args": sys.argv[3:]}))
if probe.TREE == "broken":
    sys.exit(3)
"""


@pytest.fixture
def tree_ab(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import tree_ab

    return tree_ab


def _trees(tmp_path: Path, *names: str) -> list[tuple[str, str]]:
    trees = []
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "probe.py").write_text(f"TREE = {name!r}\n")
        trees.append((name, str(tmp_path / name)))
    return trees


def test_each_round_runs_every_tree_in_its_own_process_alternating_the_order(tree_ab, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    trees = _trees(tmp_path, "before", "after")
    out = tmp_path / "rows.jsonl"
    rows = tree_ab.run_rounds(str(script), trees, 3, ["--pass", "bwd"], str(out))
    assert [row["tree"] for row in rows] == ["before", "after", "after", "before", "before", "after"]
    assert all(row["imported"] == row["tree"] for row in rows)  # each process imported from its own tree
    assert all(row["args"] == ["--pass", "bwd"] for row in rows)
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows  # lines that are not JSON dropped
    groups = tree_ab.rows_by(rows, "tree")
    assert [len(groups[(name,)]) for name, _ in trees] == [3, 3] and groups[("other",)] == []


def test_a_failing_child_stops_the_run_naming_its_round_and_tree(tree_ab, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    trees = _trees(tmp_path, "fine", "broken")
    with pytest.raises(SystemExit, match="round 0 tree broken: exit 3"):
        tree_ab.run_rounds(str(script), trees, 2, [], str(tmp_path / "rows.jsonl"))


def test_the_command_line_needs_two_trees_and_an_output(tree_ab, capsys):
    cli = tree_ab.parser("An A/B.\n\nMore.")
    args = cli.parse_args(["--tree", "a=.", "--out", "x.jsonl"])
    with pytest.raises(SystemExit):
        tree_ab.main(cli, args, "ab.py", [], lambda label: None, lambda rows, labels: [])
    assert "give two or more --tree label=path and --out" in capsys.readouterr().err
    timed = []
    args = cli.parse_args(["--child", "a"])  # a child times in its own process, no rounds
    tree_ab.main(cli, args, "ab.py", [], timed.append, lambda rows, labels: [])
    assert timed == ["a"]
