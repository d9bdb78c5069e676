"""The shipped cluster configurations parse and request what the executor relies on."""

from pathlib import Path

import yaml

from tasks.cluster import dask_client, local_cluster_size

INFRA = Path(__file__).resolve().parents[1] / "infra"


def test_slurm_gpu_workers_advertise_the_gpu_resource():
    config = yaml.safe_load((INFRA / "slurm.yaml").read_text())["jobqueue"]
    assert config["slurm-gpu"]["worker-extra-args"] == ["--resources", "GPU=1"]
    assert config["slurm"]["processes"] == config["slurm"]["cores"]  # single-threaded workers


def test_kubernetes_cluster_spec_is_a_dask_cluster():
    spec = yaml.safe_load((INFRA / "kubernetes.yaml").read_text())
    assert spec["kind"] == "DaskCluster"
    assert any(p["containerPort"] == 8786 for p in spec["spec"]["scheduler"]["spec"]["containers"][0]["ports"])


def test_gpu_worker_script_requests_the_gpu_resource():
    assert '--resources "GPU=1"' in (INFRA / "gpu-workers.sh").read_text()


def test_default_client_is_a_local_cluster_sized_to_the_machine():
    workers, threads = local_cluster_size()
    with dask_client(processes=False) as client:
        info = client.scheduler_info(n_workers=-1)["workers"]
        assert len(info) == workers
        assert all(w["nthreads"] == threads for w in info.values())


def test_prefect_deployments_point_at_flows_with_those_parameters():
    import importlib
    import inspect

    spec = yaml.safe_load((INFRA / "prefect.yaml").read_text())
    for deployment in spec["deployments"]:
        path, name = deployment["entrypoint"].split(":")
        module = path.removesuffix(".py").replace("/", ".")
        flow = getattr(importlib.import_module(module), name)
        accepted = set(inspect.signature(flow.fn).parameters)
        assert set(deployment["parameters"]) <= accepted, deployment["name"]
