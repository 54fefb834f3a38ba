"""The README's example runs as written (on the CPU: in the interpreter, with shorter sequences) and does what its
comments say."""
import re
import subprocess
import sys
from pathlib import Path

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def run_example(after: str, shorter: tuple[str, str], out_shape, lse_shape, cos_diff: float, env) -> None:
    """The README's python block after the text ``after`` (a regex), on the CPU in the interpreter with the
    replacement ``shorter`` (shorter sequences); its out and lse shapes and cos_diff as its comments say."""
    code = re.search(after + r".*?```python\n(.*?)```", README, re.S).group(1)
    code = code.replace('dev = "cuda"', 'dev = "cpu"').replace(*shorter)
    code += f"\nassert out.shape == {out_shape} and lse.shape == {lse_shape}\n"
    code += f"assert fp8mla.cal_diff(out.float(), ref)['cos_diff'] < {cos_diff}\n"
    subprocess.run([sys.executable, "-c", code], env={**env, "TRITON_INTERPRET": "1"}, check=True,
                   capture_output=True, text=True, timeout=600)


def test_readme_example_runs(env_without_interpreter):
    run_example("## Example\n\n", ("[1000, 3000, 64, 700]", "[100, 300, 64, 70]"), (4, 2, 64, 512), (4, 64, 2),
                3e-3, env_without_interpreter)


def test_readme_sparse_example_runs(env_without_interpreter):
    run_example("DeepSeek V3.2's sparse call, as vLLM's", ("2048", "256"), (2, 1, 64, 512), (2, 64, 1), 6e-3,
                env_without_interpreter)


def test_readme_names_the_commands_that_exist():
    from fp8mla.__main__ import parser

    commands = set(parser()._subparsers._group_actions[0].choices)
    assert commands == {"bench", "demo", "fetch-peers"}
    for command in re.findall(r"python -m fp8mla ([a-z-]+)", README):
        assert command in commands, command
