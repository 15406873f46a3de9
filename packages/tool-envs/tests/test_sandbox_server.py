"""The sandbox server's SandboxFusion API: schema, languages, files, stdin, auth, errors."""

from __future__ import annotations

import base64
import os

import pytest
import requests

from turnrl.tool_envs.sandbox.embedded import TEST_SERVER_ARGS, EmbeddedSandbox, shared_sandbox
from turnrl.tool_envs.sandbox.limits import SandboxLimits
from turnrl.tool_envs.sandbox.server import RequestError, check_bind, parse_request

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="Linux only")


@pytest.fixture(scope="module")
def sandbox():
    """One server for all sandbox test modules (started once, stopped at exit)."""
    return shared_sandbox(*TEST_SERVER_ARGS)


def post(sandbox, **body):
    return requests.post(f"{sandbox.url}/run_code", json=body, timeout=30)


def test_ping_reports_pong_and_isolation(sandbox):
    answer = sandbox.ping()
    assert answer["status"] == "pong"
    assert set(answer["isolation"][0]) >= {"setuid", "pid_namespace", "net_namespace", "notes"}


def test_python_hello_world_has_sandboxfusion_shape(sandbox):
    body = post(sandbox, code="print('hello')", language="python").json()
    assert body["status"] == "Success"
    assert body["compile_result"] is None
    run = body["run_result"]
    assert run["status"] == "Finished"
    assert run["return_code"] == 0
    assert run["stdout"] == "hello\n"
    assert run["stderr"] == ""
    assert 0 < run["execution_time"] < 5
    assert run["stdout_truncated"] is False
    assert body["executor_pod_name"].startswith("turnrl-sandbox")


def test_python_error_is_failed_with_traceback_of_user_code(sandbox):
    body = post(sandbox, code="x = 1\nraise ValueError('boom')", language="python").json()
    assert body["status"] == "Failed"
    run = body["run_result"]
    assert run["return_code"] == 1
    assert "ValueError: boom" in run["stderr"]
    assert "line 2" in run["stderr"]
    assert "forkserver" not in run["stderr"]  # our frames are not shown to the model


def test_sys_exit_code_is_the_return_code(sandbox):
    body = post(sandbox, code="import sys\nprint('x')\nsys.exit(7)", language="python").json()
    assert body["run_result"]["return_code"] == 7
    assert body["run_result"]["stdout"] == "x\n"


def test_bash_runs_with_exit_code_and_stderr(sandbox):
    body = post(sandbox, code="echo out; echo err >&2; exit 3", language="bash").json()
    assert body["status"] == "Failed"
    assert body["run_result"]["stdout"] == "out\n"
    assert body["run_result"]["stderr"] == "err\n"
    assert body["run_result"]["return_code"] == 3


def test_stdin_files_and_fetch_files(sandbox):
    code = "import sys\ndata = open('in/data.txt').read()\nopen('out.txt', 'w').write(data.upper() + sys.stdin.read())"
    body = post(
        sandbox,
        code=code,
        language="python",
        stdin="!",
        files={"in/data.txt": base64.b64encode(b"abc").decode()},
        fetch_files=["out.txt", "missing.txt"],
    ).json()
    assert body["status"] == "Success", body
    assert base64.b64decode(body["files"]["out.txt"]) == b"ABC!"
    assert "missing.txt" not in body["files"]


def test_fetch_files_never_leaves_the_run_directory(sandbox):
    body = post(
        sandbox,
        code="import os\nos.symlink('/etc/hostname', 'link')",
        language="python",
        fetch_files=["link", "../stdin", "/etc/hostname"],
    ).json()
    assert body["files"] == {}


def test_numpy_and_sympy_are_preloaded_and_rng_is_fresh_per_run(sandbox):
    code = "import numpy as np, sympy\nprint(sympy.factorint(360), np.random.randint(1 << 30))"
    outs = [
        post(sandbox, code=code, language="python").json()["run_result"]["stdout"] for _ in range(2)
    ]
    assert outs[0].startswith("{2: 3, 3: 2, 5: 1}")
    assert outs[0] != outs[1]


def test_environment_is_scrubbed(sandbox):
    os.environ["TURNRL_SECRET_TEST"] = "x"  # not in the server's env anyway; checks the allow-list
    code = "import os\nprint(sorted(os.environ))"
    out = post(sandbox, code=code, language="python").json()["run_result"]["stdout"]
    assert "TURNRL_SECRET_TEST" not in out
    assert eval(out) == sorted(
        [
            "PATH",
            "HOME",
            "TMPDIR",
            "LANG",
            "LC_ALL",
            "PYTHONIOENCODING",
            "PYTHONDONTWRITEBYTECODE",
            "OPENBLAS_NUM_THREADS",
            "OMP_NUM_THREADS",
            "MPLBACKEND",
        ]
    )


def test_unsupported_language_is_a_clear_422(sandbox):
    answer = post(sandbox, code="fn main() {}", language="rust")
    assert answer.status_code == 422
    assert "rust" in answer.json()["detail"] and "python" in answer.json()["detail"]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ([], "JSON object"),
        ({"language": "python"}, "code"),
        ({"code": "1", "language": "python", "run_timeout": -1}, "run_timeout"),
        ({"code": "1", "language": "python", "run_timeout": 10_000}, "run_timeout"),
        ({"code": "1", "language": "python", "memory_limit_MB": 0}, "memory_limit_MB"),
        ({"code": "1", "language": "python", "stdin": 3}, "stdin"),
        ({"code": "1", "language": "python", "files": {"a": 1}}, "files"),
        ({"code": "1", "language": "python", "fetch_files": "a"}, "fetch_files"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(body, problem):
    with pytest.raises(RequestError, match=problem):
        parse_request(body, SandboxLimits())


def test_file_path_escaping_the_run_directory_is_a_sandbox_error(sandbox):
    body = post(
        sandbox,
        code="print(1)",
        language="python",
        files={"../../evil": base64.b64encode(b"x").decode()},
    ).json()
    assert body["status"] == "SandboxError"
    assert "relative" in body["message"]


def test_body_that_is_not_json_is_422(sandbox):
    answer = requests.post(f"{sandbox.url}/run_code", data=b"{not json", timeout=10)
    assert answer.status_code == 422


def test_non_loopback_bind_requires_a_token():
    with pytest.raises(ValueError, match="requires --token"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "secret")
    check_bind("127.0.0.1", None)
    check_bind("::1", None)


def test_token_is_required_and_two_workers_share_the_load():
    with EmbeddedSandbox(*TEST_SERVER_ARGS, "--workers", "2", token="s3cret") as server:
        body = {"code": "print(1)", "language": "python"}
        assert requests.post(f"{server.url}/run_code", json=body, timeout=30).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert (
            requests.post(
                f"{server.url}/run_code", json=body, headers=wrong, timeout=30
            ).status_code
            == 401
        )
        right = {"Authorization": "Bearer s3cret"}
        answer = requests.post(f"{server.url}/run_code", json=body, headers=right, timeout=30)
        assert answer.json()["run_result"]["stdout"] == "1\n"
        ping = requests.get(f"{server.url}/v1/ping", timeout=5)  # health checks stay open
        assert len(ping.json()["isolation"]) == 2
        code = {"code": "import os\nprint(os.getuid())", "language": "python"}
        uids = {
            requests.post(f"{server.url}/run_code", json=code, headers=right, timeout=30).json()[
                "run_result"
            ]["stdout"]
            for _ in range(4)
        }
        if ping.json()["isolation"][0]["setuid"]:  # each fork server has its own uid range
            assert len(uids) == 2


def test_exec_mode_runs_a_fresh_interpreter():
    with EmbeddedSandbox(*TEST_SERVER_ARGS, "--python-mode", "exec") as server:
        body = {"code": "import sys\nprint('numpy' in sys.modules)", "language": "python"}
        answer = requests.post(f"{server.url}/run_code", json=body, timeout=30).json()
        assert answer["run_result"]["stdout"] == "False\n", answer


def test_cli_refuses_more_run_uids_than_a_port_owns(monkeypatch):
    from turnrl.tool_envs.sandbox import cli

    monkeypatch.delenv("TURNRL_SANDBOX_TOKEN", raising=False)
    with pytest.raises(SystemExit, match="--base-uid"):
        cli.main(["serve", "--port", "9999", "--workers", "20", "--slots", "64"])
    with pytest.raises(SystemExit, match="requires --token"):
        cli.main(["serve", "--host", "0.0.0.0", "--port", "9999"])
