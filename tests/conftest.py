"""Shared test setup: offline, quiet, deterministic."""

import os
import tempfile

import pytest
import torch

# nothing may download during tests (spec §6); loaders raise DataError instead
os.environ.setdefault("FL_SPLIT_NO_DOWNLOAD", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
# `fl-split train` without --out writes a run directory (fl_split.rundir): never into the checkout
os.environ.setdefault("FL_SPLIT_RUNS", tempfile.mkdtemp(prefix="fl-split-test-runs-"))


@pytest.fixture(autouse=True)
def _torch_threads():
    # two-core CI machine: one intra-op thread keeps runs deterministic and avoids oversubscription
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def flower_task_identity():
    """The coordinator's ``Message()`` needs the process's Flower task identity (Flower sets it in a
    real ServerApp process); restore whatever was there. Modules that build Flower messages use it
    with ``pytestmark = pytest.mark.usefixtures("flower_task_identity")``."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 11, 7, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


@pytest.fixture(scope="session")
def tls_deployment(tmp_path_factory):
    """One ``deploy local --tls`` run with a private seed file, sampled while it ran
    (:func:`tests.shared_runs.sampled_tls_deployment`): tests/test_deploy.py and
    tests/test_adversary_secrets.py assert on the same run."""
    from tests.shared_runs import sampled_tls_deployment
    from tests.test_deploy import SMALL

    return sampled_tls_deployment(tmp_path_factory.mktemp("tls-deployment"), SMALL)


@pytest.fixture(scope="session")
def psi_table_deployment(tmp_path_factory):
    """One ``deploy local --data … --align psi`` run on tables with text IDs, and the local engine's
    (:func:`tests.shared_runs.psi_table_deployment`): tests/test_join_keys.py and
    tests/test_deploy_align.py assert on the same run."""
    from tests.shared_runs import psi_table_deployment

    return psi_table_deployment(tmp_path_factory.mktemp("psi-table-deployment"))
