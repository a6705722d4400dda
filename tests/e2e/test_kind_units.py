"""The parts of `make e2e-kind` that run without a Docker engine: the capability shim that lets
dockerd start privileged containers on a host whose bounding set withholds a capability, and
the kindnetd stand-in's CNI config. (`make e2e-kind` itself runs them for real.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.e2e import kindnet, runc_shim

ALL = 0x1FFFFFFFFFF  # capabilities 0-40
THIS_VM = 0x1FFFEFFFFFF  # `grep CapBnd /proc/self/status` here: bit 24 (CAP_SYS_RESOURCE) clear
PRIVILEGED = ["CAP_CHOWN", "CAP_SYS_ADMIN", "CAP_SYS_RESOURCE", "CAP_NET_ADMIN"]


def _caps() -> dict[str, list[str]]:
    return {key: list(PRIVILEGED) for key in runc_shim.CAP_SETS}


def test_withheld_names_the_capabilities_the_bounding_set_lacks() -> None:
    assert runc_shim.withheld(THIS_VM) == {"CAP_SYS_RESOURCE"}
    assert runc_shim.withheld(ALL) == set()
    status = "Name:\tx\nCapBnd:\t000001fffeffffff\nCapAmb:\t0\n"
    assert runc_shim.bounding_set(status) == THIS_VM


def test_create_drops_withheld_caps_from_the_bundle_and_keeps_the_rest(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"process": {"capabilities": _caps()}}))
    argv = ["--root", "/run/x", "--log-format", "json", "create", "--bundle", str(tmp_path), "id"]
    runc_shim.rewrite(argv, {"CAP_SYS_RESOURCE"})
    caps = json.loads((tmp_path / "config.json").read_text())["process"]["capabilities"]
    for key in runc_shim.CAP_SETS:
        assert caps[key] == ["CAP_CHOWN", "CAP_SYS_ADMIN", "CAP_NET_ADMIN"], key


def test_exec_drops_withheld_caps_from_the_process_spec(tmp_path: Path) -> None:
    process = tmp_path / "process.json"
    process.write_text(json.dumps({"args": ["sh"], "capabilities": _caps()}))
    runc_shim.rewrite(["exec", "--process", str(process), "--detach", "id"], {"CAP_SYS_RESOURCE"})
    spec = json.loads(process.read_text())
    assert "CAP_SYS_RESOURCE" not in spec["capabilities"]["bounding"]
    assert spec["args"] == ["sh"]


def test_shim_passes_every_argument_to_the_real_runc(tmp_path: Path) -> None:
    fake_runc = tmp_path / "runc"
    fake_runc.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake_runc.chmod(0o755)
    (tmp_path / "config.json").write_text(json.dumps({"process": {"capabilities": _caps()}}))
    argv = ["--root", "/run/x", "create", "-b", str(tmp_path), "--pid-file", "p", "id"]
    env = {**os.environ, "EMBER_REAL_RUNC": str(fake_runc)}
    out = subprocess.run(
        [sys.executable, runc_shim.__file__, *argv],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == argv
    withheld = runc_shim.withheld(runc_shim.bounding_set(Path("/proc/self/status").read_text()))
    caps = json.loads((tmp_path / "config.json").read_text())["process"]["capabilities"]
    assert not withheld & set(caps["bounding"])  # this host's own withheld set is gone


def test_kindnet_conflist_is_kindnetds_layout_for_the_nodes_pod_cidr() -> None:
    conf = json.loads(kindnet.conflist("10.244.1.0/24"))
    ptp, portmap = conf["plugins"]
    assert ptp["type"] == "ptp" and portmap["type"] == "portmap"
    assert ptp["ipam"]["ranges"] == [[{"subnet": "10.244.1.0/24"}]]
    node = {"status": {"addresses": [{"type": "InternalIP", "address": "fc00::3"},
                                     {"type": "InternalIP", "address": "172.18.0.3"}]}}  # fmt: skip
    assert kindnet.internal_ip(node) == "172.18.0.3"
