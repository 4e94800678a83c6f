"""What environment `meshserve up` gives each child service."""

from meshserve.local.launcher import child_env


def test_services_get_sleeping_openmp_threads_unless_told_otherwise() -> None:
    for role in ("worker", "gateway", "tokenizer"):
        assert child_env(role, {"PATH": "/bin"})["OMP_WAIT_POLICY"] == "PASSIVE"
    assert child_env("worker", {"OMP_WAIT_POLICY": "ACTIVE"})["OMP_WAIT_POLICY"] == "ACTIVE"


def test_children_get_only_the_meshserve_variables_their_config_knows() -> None:
    environ = {"MESHSERVE_API_KEY": "k", "MESHSERVE_BLOCK_SIZE": "32", "HOME": "/root"}
    gateway = child_env("gateway", environ)
    assert gateway["MESHSERVE_API_KEY"] == "k" and "MESHSERVE_BLOCK_SIZE" not in gateway
    worker = child_env("worker", environ)
    assert worker["MESHSERVE_BLOCK_SIZE"] == "32" and "MESHSERVE_API_KEY" not in worker
    assert worker["HOME"] == gateway["HOME"] == "/root"
