"""``python -m fp8mla fetch-peers [DIR]``: the peer kernels the bench compares with, taken from the vllm wheel on
the package index (its prebuilt, torch stable-ABI extensions; Apache-2.0) into DIR (default ``.peers``, which the
repository's .gitignore keeps out of git):

  _flashmla_C.abi3.so             FlashMLA BF16 dense and sparse decode -> torch.ops._flashmla_C
  _flashmla_extension_C.abi3.so   FlashMLA dense FP8 (vLLM's)          -> torch.ops._flashmla_extension_C
  _vllm_fa3_C.abi3.so.xz          FA3 with MLA support (--fa3; 172 MB unpacked, ~8 MB xz; peers.py unpacks it)

The wheel (hundreds of MB) is downloaded once into a temporary folder by pip, for Linux x86-64 and the Python the
GPU machine runs (--python, default 3.12), then deleted.
"""
from __future__ import annotations

import lzma
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

VLLM_VERSION = "0.33.0"   # the release the peers were measured from (../shared/ANCHORS.md)
MEMBERS = {"vllm/_flashmla_C.abi3.so": "_flashmla_C.abi3.so",
           "vllm/_flashmla_extension_C.abi3.so": "_flashmla_extension_C.abi3.so"}
FA3_MEMBER = ("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "_vllm_fa3_C.abi3.so.xz")


def download_wheel(version: str, python: str, folder: str, progress) -> str:
    """The vllm wheel's path, downloaded by pip into ``folder``."""
    progress(f"downloading the vllm {version} wheel (Linux x86-64, CPython {python}) with pip ...")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                    "-d", folder, f"vllm=={version}"], check=True)
    wheels = [f for f in os.listdir(folder) if f.startswith("vllm-") and f.endswith(".whl")]
    if len(wheels) != 1:
        raise RuntimeError(f"pip left {wheels} in {folder}, expected one vllm wheel")
    return os.path.join(folder, wheels[0])


def extract(wheel: str, dest: str, fa3: bool, progress) -> list[str]:
    """The peers' binaries from ``wheel`` into ``dest``; returns the files written."""
    os.makedirs(dest, exist_ok=True)
    written = []
    with zipfile.ZipFile(wheel) as z:
        for member, name in MEMBERS.items():
            with z.open(member) as src, open(os.path.join(dest, name), "wb") as dst:
                shutil.copyfileobj(src, dst)
            written.append(name)
        if fa3:
            member, name = FA3_MEMBER
            progress(f"compressing {member.rsplit('/', 1)[1]} (xz, about a minute) ...")
            with z.open(member) as src, lzma.open(os.path.join(dest, name), "wb", preset=6) as dst:
                shutil.copyfileobj(src, dst)
            written.append(name)
    for name in written:
        progress(f"  {os.path.join(dest, name)}: {os.path.getsize(os.path.join(dest, name)) / 2**20:.1f} MiB")
    return written


def fetch_peers(dest: str = ".peers", version: str = VLLM_VERSION, python: str = "3.12", fa3: bool = False,
                progress=print) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        return extract(download_wheel(version, python, tmp, progress), dest, fa3, progress)


def add_arguments(parser) -> None:
    parser.add_argument("dest", nargs="?", default=".peers", help="folder for the binaries (keep it out of git)")
    parser.add_argument("--vllm", default=VLLM_VERSION, help="the vllm release to take them from")
    parser.add_argument("--python", default="3.12", help="the CPython version of the machine that will load them")
    parser.add_argument("--fa3", action="store_true", help="also FA3-MLA (172 MB unpacked, stored xz-compressed)")
