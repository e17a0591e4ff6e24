"""A checkpoint from elsewhere cannot run code, point reads outside itself or switch its
checksums off."""

from __future__ import annotations

import json
import os
import pickle
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from torch import nn

import ds_strategy
from ds_strategy.cli import main as cli
from ds_strategy.core.checkpoint.validate import crc32


def _engine() -> ds_strategy.ZeroEngine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    return ds_strategy.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {})


def _rewrite_json(ckpt: Path, change) -> None:  # type: ignore[no-untyped-def]
    meta_path = ckpt / "ds_strategy.json"
    meta = json.loads(meta_path.read_text())
    change(meta)
    meta_path.write_text(json.dumps(meta))


@pytest.mark.parametrize("name", ["/etc", "../elsewhere/step5", ".."])
def test_latest_holding_a_path_is_refused(tmp_path: Path, name: str) -> None:
    engine = _engine()
    engine.save_checkpoint(tmp_path / "root", tag="step1")
    (tmp_path / "root" / "latest").write_text(name)
    with pytest.raises(ValueError, match="never a path"):
        engine.load_checkpoint(tmp_path / "root")
    with pytest.raises(ValueError, match="never a path"):
        ds_strategy.consolidate(tmp_path / "root", tmp_path / "out.safetensors")


@pytest.mark.parametrize("by", ["latest", "tag"])
def test_a_tag_that_links_outside_its_root_is_refused(tmp_path: Path, by: str) -> None:
    """``root/step2 -> ../victim/step9``: named by ``latest`` or by ``tag=``, never read."""
    engine = _engine()
    engine.save_checkpoint(tmp_path / "victim", tag="step9")
    engine.save_checkpoint(tmp_path / "root", tag="step1")
    (tmp_path / "root" / "step2").symlink_to(tmp_path / "victim" / "step9")
    if by == "latest":
        (tmp_path / "root" / "latest").write_text("step2")
    with pytest.raises(ds_strategy.CheckpointError, match=r"step2: a link to .*victim"):
        engine.load_checkpoint(tmp_path / "root", tag=None if by == "latest" else "step2")
    with pytest.raises(ds_strategy.CheckpointError, match="outside"):
        ds_strategy.consolidate(
            tmp_path / "root", tmp_path / "out.safetensors", tag=None if by == "latest" else "step2"
        )
    assert not (tmp_path / "out.safetensors").exists()


def test_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    engine = _engine()
    outside = tmp_path / "other"
    engine.save_checkpoint(outside)
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(ckpt)
    # an attacker rewrites every reference to the other checkpoint and fixes the checksums
    md_path = ckpt / ".metadata"
    md = pickle.loads(md_path.read_bytes())
    for info in md.storage_data.values():
        info.relative_path = f"../other/{info.relative_path}"
    md_path.write_bytes(pickle.dumps(md))

    def fix(meta: dict) -> None:
        meta["files"][".metadata"] = {"size": md_path.stat().st_size, "crc32": crc32(md_path)}

    _rewrite_json(ckpt, fix)
    with pytest.raises(ValueError, match=r"references '\.\./other/.*outside the checkpoint"):
        engine.load_checkpoint(ckpt)
    with pytest.raises(ValueError, match="outside the checkpoint"):
        ds_strategy.consolidate(ckpt, tmp_path / "out.safetensors")


def test_checkpoint_without_checksums_needs_an_explicit_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = _engine()
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(ckpt)
    want = engine.full_state_dict()
    # with its checksums dropped, altered data would load silently: refused by default
    _rewrite_json(ckpt, lambda meta: meta.pop("files"))
    with pytest.raises(ValueError, match="records no checksums.*require_checksums=False"):
        engine.load_checkpoint(ckpt)
    with pytest.raises(ValueError, match="records no checksums"):
        ds_strategy.consolidate(ckpt, tmp_path / "out.safetensors")
    assert cli(["consolidate", str(ckpt), str(tmp_path / "a.safetensors")]) == 2
    assert "no-require-checksums" in capsys.readouterr().err
    # the explicit option loads it
    engine.load_checkpoint(ckpt, require_checksums=False)
    got = engine.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    out = tmp_path / "b.safetensors"
    assert cli(["consolidate", str(ckpt), str(out), "--no-require-checksums"]) == 0
    assert out.is_file()


# -- nothing in a checkpoint runs code -----------------------------------------------------------


class Planted:
    """Unpickling this runs a shell command: what a crafted checkpoint would hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def _fix_checksum(ckpt: Path, name: str) -> None:
    f = ckpt / name

    def fix(meta: dict) -> None:
        meta["files"][name] = {"size": f.stat().st_size, "crc32": crc32(f)}

    _rewrite_json(ckpt, fix)


def test_planted_metadata_runs_nothing_in_load_or_consolidate(tmp_path: Path) -> None:
    engine = _engine()
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(ckpt)
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    _fix_checksum(ckpt, ".metadata")  # all an attacker needs
    with pytest.raises(ValueError, match=r"names posix\.system.*refusing"):
        engine.load_checkpoint(ckpt)
    with pytest.raises(ValueError, match=r"names posix\.system"):
        ds_strategy.consolidate(ckpt, tmp_path / "out.safetensors")
    assert cli(["consolidate", str(ckpt), str(tmp_path / "out.pt")]) == 2
    assert not marker.exists()


def test_planted_client_state_runs_nothing(tmp_path: Path) -> None:
    engine = _engine()
    marker = tmp_path / "pwned"
    engine.save_checkpoint(tmp_path / "ckpt", client_state={"step": 3, "x": Planted(marker)})
    assert not marker.exists()  # saving pickles the reduce tuple, it runs nothing
    with pytest.raises(ValueError, match=r"'client_state'.*holds posix\.system.*trust_checkpoint"):
        engine.load_checkpoint(tmp_path / "ckpt")
    assert not marker.exists()


def test_plain_client_state_loads_and_objects_need_trust(tmp_path: Path) -> None:
    engine = _engine()
    plain = {"epoch": 3, "name": "run", "best": torch.tensor(0.25), "hist": [1.0, (2, 3)]}
    engine.save_checkpoint(tmp_path / "plain", client_state=plain)
    got = engine.load_checkpoint(tmp_path / "plain")
    assert got["epoch"] == 3 and got["hist"] == [1.0, (2, 3)] and float(got["best"]) == 0.25
    engine.save_checkpoint(tmp_path / "obj", client_state={"ratio": Fraction(1, 3)})
    with pytest.raises(ValueError, match=r"fractions\.Fraction"):
        engine.load_checkpoint(tmp_path / "obj")
    assert engine.load_checkpoint(tmp_path / "obj", trust_checkpoint=True) == {
        "ratio": Fraction(1, 3)
    }
