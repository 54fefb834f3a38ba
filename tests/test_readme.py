"""The README's example runs as written (on the CPU: in the interpreter, with shorter sequences) and does what its
comments say."""
import re
import subprocess
import sys
from pathlib import Path

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_readme_example_runs(env_without_interpreter):
    code = re.search(r"## Example\n\n```python\n(.*?)```", README, re.S).group(1)
    code = code.replace('dev = "cuda"', 'dev = "cpu"').replace("[1000, 3000, 64, 700]", "[100, 300, 64, 70]")
    code += "\nassert out.shape == (4, 2, 64, 512) and lse.shape == (4, 64, 2)\n"
    code += "assert fp8mla.cal_diff(out.float(), ref)['cos_diff'] < 3e-3\n"
    env = {**env_without_interpreter, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True, timeout=600)


def test_readme_names_the_commands_that_exist():
    from fp8mla.__main__ import parser

    commands = set(parser()._subparsers._group_actions[0].choices)
    assert commands == {"bench", "demo", "fetch-peers"}
    for command in re.findall(r"python -m fp8mla ([a-z-]+)", README):
        assert command in commands, command
