"""``vescale-zero consolidate`` / ``convert``: bad input gets one line naming the problem and
the command to use instead (exit 2), never a traceback. The directories are stood in for by
the marker files that identify each framework's checkpoints."""

from __future__ import annotations

import json
import re

import pytest

from vescale_zero.tools.cli import main


def _one_error_line(capsys, command: str) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vescale-zero {command}: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]

def _deepspeed_save_dir(root, tags=("global_step2",), latest=True, stage3=False):
    for tag in tags:
        (root / tag).mkdir(parents=True)
        (root / tag / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if stage3 else "mp_rank_00_model_states.pt")
         ).write_bytes(b"")
    if latest:
        (root / "latest").write_text(tags[-1])
    return root

@pytest.mark.parametrize("what, expected", [
    ("missing", r"no checkpoint at '.*missing'"),
    ("deepspeed save_dir", r"is a DeepSpeed save directory .*`vescale-zero convert --from deepspeed \S+ds DST`"),
    ("deepspeed stage-3 save_dir", r"DeepSpeed save directory .*`vescale-zero convert --from deepspeed \S+ds DST`"),
    ("deepspeed tag dir", r"DeepSpeed checkpoint \(tag 'global_step2'\).*--from deepspeed \S+ds DST "
                          r"--tag global_step2"),
    ("fsdp2 dcp", r"DCP \(PyTorch FSDP2\) checkpoint.*`vescale-zero convert --from fsdp2 "),
    ("megatron torch_dist", r"Megatron torch_dist checkpoint.*`vescale-zero convert --from megatron "),
    ("megatron save dir", r"Megatron save directory.*`vescale-zero convert --from megatron "),
    ("our save dir", r"a directory of checkpoints, not one checkpoint: its latest is '\S+step5'"),
    ("our partial save", r"metadata.json is missing: .* partial checkpoint"),
], ids=lambda v: v.replace(" ", "-") if " " in v or v == "missing" else "")
def test_consolidate_names_what_it_was_given(tmp_path, capsys, what, expected):

    path = tmp_path / "ds"
    if what.startswith("deepspeed"):
        _deepspeed_save_dir(path, stage3="stage-3" in what)
        if what == "deepspeed tag dir":
            path = path / "global_step2"
    elif what == "fsdp2 dcp":
        path.mkdir()
        (path / ".metadata").write_bytes(b"")
    elif what == "megatron torch_dist":
        path.mkdir()
        (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    elif what == "megatron save dir":
        (path / "iter_0000005").mkdir(parents=True)
        (path / "latest_checkpointed_iteration.txt").write_text("5")
    elif what == "our save dir":
        (path / "step5").mkdir(parents=True)
        (path / "step5" / "metadata.json").write_text(json.dumps({"format": "vescale-zero/ragged-v1"}))
        (path / "latest").write_text("step5")
    elif what == "our partial save":
        path.mkdir()
        (path / "rank00000.pt").write_bytes(b"")
    else:
        path = tmp_path / "missing"
    assert main(["consolidate", str(path), str(tmp_path / "out.pt")]) == 2
    assert re.search(expected, _one_error_line(capsys, "consolidate"))
    assert not (tmp_path / "out.pt").exists()

def test_convert_from_deepspeed_without_latest(tmp_path, capsys):
    """No ``latest``: a DeepSpeed save directory gets its tags; a tag directory gets its parent
    and ``--tag``; anything else is said not to be a DeepSpeed checkpoint (no ``--tag`` advice)."""
    saves = _deepspeed_save_dir(tmp_path / "saves", tags=("global_step3", "global_step7"), latest=False)
    elsewhere = tmp_path / "notes"
    elsewhere.mkdir()
    (elsewhere / "readme.txt").write_text("not a checkpoint")
    cases = [
        (saves, r"saves/latest is missing: pass one of its tags, e.g. --tag global_step7 "
                r"\(tags: global_step3, global_step7\)"),
        (saves / "global_step3",
         r"is one DeepSpeed tag directory: .*`--from deepspeed \S+saves DST --tag global_step3`"),
        (elsewhere, r"'\S+notes' is not a DeepSpeed checkpoint: it has no 'latest' file and no tag directory"),
    ]

    for src, expected in cases:
        assert main(["convert", "--from", "deepspeed", str(src), str(tmp_path / "dst")]) == 2
        line = _one_error_line(capsys, "convert")
        assert re.search(expected, line), line
        if src == elsewhere:
            assert "--tag" not in line
        assert not (tmp_path / "dst").exists()
