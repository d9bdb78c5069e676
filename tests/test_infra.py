"""The shipped cluster configurations: clusters start by class path from the pipeline config, the
jobqueue profiles build job scripts, the deployment and image files point at what exists."""

import os
import time
from pathlib import Path

import dask
import pytest
import yaml

from tasks.cluster import dask_client, local_cluster_size, read_dask_config, start_cluster

INFRA = Path(__file__).resolve().parents[1] / "infra"


@pytest.mark.parametrize("cluster_class, config_file, profile, directive", [
    ("dask_jobqueue.SLURMCluster", "slurm.yaml", "slurm-gpu", "#SBATCH --gres=gpu:1"),
    ("dask_jobqueue.PBSCluster", "pbs.yaml", "pbs-gpu", "#PBS -l select=1:ncpus=8:ngpus=1:mem=64GB"),
])
def test_jobqueue_gpu_profiles_build_job_scripts_for_one_gpu_worker(cluster_class, config_file, profile, directive):
    pytest.importorskip("dask_jobqueue", reason="dask-jobqueue is in the dev extra")
    with start_cluster(cluster_class, {"config_name": profile}, dask_config=read_dask_config(INFRA / config_file)) as cluster:
        script = cluster.job_script()  # no batch system needed: the scheduler runs here, no job is submitted
    assert directive in script and "--resources GPU=1" in script and "--nthreads 8" in script
    assert "--nworkers" not in script  # one worker per GPU


@pytest.mark.parametrize("cluster_class, config_file", [("dask_jobqueue.SLURMCluster", "slurm.yaml"), ("dask_jobqueue.PBSCluster", "pbs.yaml")])
def test_jobqueue_cpu_profiles_run_single_threaded_workers(cluster_class, config_file):
    pytest.importorskip("dask_jobqueue", reason="dask-jobqueue is in the dev extra")
    with start_cluster(cluster_class, dask_config=read_dask_config(INFRA / config_file)) as cluster:
        script = cluster.job_script()
    assert "--nthreads 1" in script and "--nworkers 4" in script and "OMP_NUM_THREADS=1" in script


@pytest.mark.parametrize("cluster_class, config_file, profile", [
    ("dask_jobqueue.SLURMCluster", "slurm.yaml", "slurm"), ("dask_jobqueue.SLURMCluster", "slurm.yaml", "slurm-gpu"),
    ("dask_jobqueue.PBSCluster", "pbs.yaml", "pbs"), ("dask_jobqueue.PBSCluster", "pbs.yaml", "pbs-gpu")])
def test_the_worker_command_of_a_job_keeps_its_arguments_where_the_batch_system_sets_no_tmpdir(cluster_class, config_file, profile):
    """``--local-directory $TMPDIR`` became ``--local-directory`` followed by the next option on a
    site whose jobs have no TMPDIR (Slurm sets none by default): every worker died at start."""
    import shlex
    import subprocess

    pytest.importorskip("dask_jobqueue", reason="dask-jobqueue is in the dev extra")
    with start_cluster(cluster_class, {"config_name": profile}, dask_config=read_dask_config(INFRA / config_file)) as cluster:
        command = cluster.job_script().strip().splitlines()[-1]  # the worker's command line, as the job's shell reads it
    assert "dask_worker" in command
    env = {key: value for key, value in os.environ.items() if key != "TMPDIR"}
    words = subprocess.run(["sh", "-c", f"printf '%s\\n' {command}"], env=env, capture_output=True, text=True, check=True).stdout.splitlines()
    assert words[:2] == shlex.split(command)[:2]
    directory = words[words.index("--local-directory") + 1]
    assert directory == "/tmp", words


def test_a_cluster_class_path_with_cluster_kwargs_starts_that_cluster():
    from distributed import Client, SpecCluster

    spec = {"scheduler": {"cls": "distributed.Scheduler", "options": {"dashboard_address": ":0"}},
            "workers": {"a": {"cls": "distributed.Worker", "options": {"nthreads": 1}},
                        "b": {"cls": "distributed.Worker", "options": {"nthreads": 2}}}}
    with start_cluster("distributed.SpecCluster", spec) as cluster, Client(cluster) as client:
        assert type(cluster) is SpecCluster
        assert sorted(w["nthreads"] for w in client.scheduler_info(n_workers=-1)["workers"].values()) == [1, 2]
        assert client.submit(sum, [1, 2, 3]).result() == 6


def test_an_adaptive_cluster_grows_under_load_within_its_bounds():
    from distributed import Client

    with start_cluster("distributed.LocalCluster", {"n_workers": 1, "processes": False},
                       {"minimum": 1, "maximum": 2, "interval": "50ms", "wait_count": 1}) as cluster, Client(cluster) as client:
        client.wait_for_workers(1, timeout=10)
        futures = client.map(time.sleep, [0.5] * 16, pure=False)
        deadline = time.monotonic() + 20
        while len(cluster.workers) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(cluster.workers) == 2
        client.gather(futures)
        assert len(cluster.workers) <= 2


def test_a_cluster_class_that_is_not_one_fails_naming_it():
    with pytest.raises(ValueError, match=r"cluster class 'distributed.Client': distributed has no Dask cluster class 'Client'"):
        with start_cluster("distributed.Client"):
            pass
    with pytest.raises(ValueError, match=r"cannot import dask_nowhere"):
        with start_cluster("dask_nowhere.Cluster"):
            pass


@pytest.mark.parametrize("cluster_kwargs, adapt_kwargs, problem", [
    ({"n_workers": 1, "processes": False, "memory_limit": "lots"}, None,
     r"dask.cluster_kwargs.memory_limit: 'lots': LocalCluster did not start: Could not interpret 'lots' as a byte unit"),
    ({"n_workers": 1, "processes": False}, {"minimum": 1, "maximum": 2, "interval": "fast"},
     r"dask.adapt_kwargs.interval: 'fast' is no duration \(e.g. '500ms', '5s', 2\): Invalid time unit: fast"),
    ({"n_workers": 1, "processes": False, "interface": "ib9"}, None,  # a compute node's config: 'Cluster failed to start' and a traceback
     r"dask.cluster_kwargs.interface: 'ib9': LocalCluster did not start: ValueError: 'ib9' is not a valid network interface"),
])
def test_a_cluster_setting_the_cluster_refuses_is_an_input_error_naming_it(cluster_kwargs, adapt_kwargs, problem):
    """``memory_limit: lots`` failed with the library's traceback through its event loop and no word of the
    configuration; it is now an input error (one console line, as a bad table's) naming the setting. An
    error that quotes no value of the configuration (a bug in a cluster class) keeps its own traceback."""
    import logging
    import sys

    from flows.cli import _WithoutInputTracebacks
    from tasks.cluster import ClusterSettingError

    with pytest.raises(ClusterSettingError, match=problem):
        with start_cluster(None, cluster_kwargs, adapt_kwargs):
            pass
    try:
        with start_cluster(None, cluster_kwargs, adapt_kwargs):
            pass
    except ClusterSettingError:
        record = logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    assert "Traceback" not in _WithoutInputTracebacks(logging.Formatter("%(message)s")).format(record)
    with pytest.raises(KeyError, match="Invalid time unit: fast"):  # a dask config file's value: not the cluster_kwargs'
        with start_cluster(None, {"n_workers": 1, "processes": False}, dask_config={"distributed": {"comm": {"timeouts": {"connect": "fast"}}}}):
            pass


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


def test_the_image_that_kubernetes_runs_is_built_from_files_that_exist_with_the_pinned_dependencies():
    import fnmatch
    import shlex
    import tomllib

    root = INFRA.parent
    dockerfile = (INFRA / "Dockerfile").read_text()
    lines = [line.strip() for line in dockerfile.replace("\\\n", " ").splitlines() if line.strip() and not line.lstrip().startswith("#")]
    copies = [shlex.split(line)[1:-1] for line in lines if line.startswith("COPY ")]
    ignore = [p for p in (root / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    for source in (s for sources in copies for s in sources):
        assert (root / source).exists(), f"COPY {source}: not in the repository"
        sent = [p[1:].rstrip("/") == source.rstrip("/") for p in ignore if p.startswith("!")]
        assert any(sent), f"{source} is left out of the build context by .dockerignore"
    install = next(line for line in lines if "pip install" in line)
    assert "-c constraints.txt" in install and "COPY pyproject.toml README.md constraints.txt ./" in lines
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    default_extras = next(line.split("=", 1)[1] for line in lines if line.startswith("ARG EXTRAS="))
    assert set(default_extras.split(",")) <= set(extras)
    built_tag = next(word for word in dockerfile.split() if fnmatch.fnmatch(word, "*/gpmil:*"))
    images = [c["image"] for part in ("worker", "scheduler") for c in yaml.safe_load((INFRA / "kubernetes.yaml").read_text())
              ["spec"][part]["spec"]["containers"]]
    assert images == [built_tag, built_tag]
    home = next(line for line in lines if "GPMIL_HOME=" in line).split("GPMIL_HOME=")[1].split()[0]
    workdir = next(line.split()[1] for line in lines if line.startswith("WORKDIR "))
    assert home == workdir  # prefect.yaml's pull step runs the entrypoints from $GPMIL_HOME
    for deployment in yaml.safe_load((INFRA / "prefect.yaml").read_text())["deployments"]:
        assert (root / deployment["entrypoint"].split(":")[0]).is_file()


def test_a_config_file_sets_its_keys_without_dropping_the_rest_of_their_section():
    """A file holding distributed: {worker: {resources: {GPU: 1}}} replaced all of 'distributed'
    while the cluster started: KeyError: 'comm'."""
    from distributed import Client

    resources = {"distributed": {"worker": {"resources": {"GPU": 1}}}}
    with start_cluster(None, {"n_workers": 1, "processes": False}, dask_config=resources) as cluster, Client(cluster) as client:
        assert dask.config.get("distributed.comm.timeouts.connect")  # the rest of the section is still there
        assert [w["resources"] for w in client.scheduler_info()["workers"].values()] == [{"GPU": 1}]


def test_a_scheduler_address_where_no_dask_scheduler_answers_fails_in_seconds():
    """A dashboard port (or any server that waits for a request) made Client() wait forever."""
    import socket

    from distributed import Client, LocalCluster

    from tasks.cluster import check_scheduler_answers, wait_for_first_worker

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"accepts connections there but sent no Dask handshake within 1 s"):
            check_scheduler_answers(f"tcp://127.0.0.1:{silent.getsockname()[1]}", 1.0)
        assert time.monotonic() - started < 5
        port = silent.getsockname()[1]
    with pytest.raises(OSError, match=rf"tcp://127.0.0.1:{port}: no Dask scheduler answers"):
        check_scheduler_answers(f"tcp://127.0.0.1:{port}", 1.0)
    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster:
        check_scheduler_answers(cluster.scheduler_address, 5.0)
        with Client(cluster) as client, pytest.raises(TimeoutError, match=r"no Dask worker arrived within 1.5 s \(dask.worker_timeout_s"):
            wait_for_first_worker(client, 1.5)  # polled a second at a time: the last poll's error said 'after 0.5'


def test_a_tls_scheduler_answers_after_the_tls_handshake_with_the_configured_client_certificates(tmp_path):
    """A tls:// scheduler waits for the client's TLS hello, so the check that a scheduler speaks
    first refused every TLS scheduler ("sent no Dask handshake") that a Dask client reached."""
    import socket

    from distributed import Client, LocalCluster
    from distributed.security import Security

    from tasks.cluster import ClusterSettingError, check_scheduler_answers

    ours, theirs = Security.temporary(), Security.temporary()  # theirs: another CA
    client_config = {}
    for security, folder in ((ours, tmp_path / "ours"), (theirs, tmp_path / "theirs")):
        folder.mkdir()
        for key, name in (("ca-file", "tls_ca_file"), ("client.cert", "tls_client_cert"), ("client.key", "tls_client_key")):
            (folder / name).write_text(getattr(security, name))
            client_config.setdefault(folder.name, {})[f"distributed.comm.tls.{key}"] = str(folder / name)
    with LocalCluster(n_workers=0, processes=False, protocol="tls://", security=ours, dashboard_address=":0") as cluster:
        with pytest.raises(ClusterSettingError, match="a tls:// scheduler needs the client's certificates"):
            check_scheduler_answers(cluster.scheduler_address, 5.0)
        with dask.config.set(client_config["theirs"]), pytest.raises(OSError, match="no TLS handshake with a Dask scheduler"):
            check_scheduler_answers(cluster.scheduler_address, 5.0)
        with dask.config.set(client_config["ours"]):
            check_scheduler_answers(cluster.scheduler_address, 5.0)
            with Client(cluster.scheduler_address, timeout=10) as client:  # as the run's client connects
                assert client.scheduler_info()["address"] == cluster.scheduler_address
            with socket.socket() as silent:
                silent.bind(("127.0.0.1", 0))
                silent.listen()
                with pytest.raises(TimeoutError, match="sent no Dask handshake within 1 s"):
                    check_scheduler_answers(f"tls://127.0.0.1:{silent.getsockname()[1]}", 1.0)


def test_a_batch_job_that_cannot_be_submitted_fails_the_run_at_once_with_the_submission_error(tmp_path, monkeypatch):
    """sbatch refused the job (a wrong partition): the run waited out worker_timeout_s and then
    failed with 'AssertionError: Status.created' from closing the cluster, the reason only in a
    background traceback."""
    from flows.config import load_config
    from flows.pipeline import run_cluster
    from tasks.cluster import WorkersDidNotStartError

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: compute' >&2\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"name": "t", "store": "s.zarr", "output_dir": "out", "dask": {
        "cluster_class": "dask_jobqueue.SLURMCluster", "config_file": str(INFRA / "slurm.yaml"),
        "cluster_kwargs": {"config_name": "slurm"}, "n_workers": 2, "worker_timeout_s": 300}}))
    started = time.monotonic()
    with pytest.raises(WorkersDidNotStartError, match="(?s)SLURMCluster could not start a worker: .*sbatch: error: invalid partition specified: compute"):
        with run_cluster(load_config(config)):
            pass
    assert time.monotonic() - started < 120  # not the 300 s of worker_timeout_s


def test_adapt_kwargs_the_clusters_adapt_does_not_take_or_job_bounds_that_start_nothing_are_refused_at_load(tmp_path):
    """adapt_kwargs {minimum: 1, maximun: 4} loaded, and the adaptive scaler's maximum was inf (on
    Slurm: unlimited job submissions; the typo only failed in the scheduler's log); dask-jobqueue's
    minimum_jobs: 0 replaced the checked minimum of one worker, and the run waited for a worker no
    job would start."""
    from flows.config import ConfigError, load_config

    def load(dask: dict):
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump({"name": "t", "store": "s.zarr", "output_dir": "out", "dask": dask}))
        return load_config(config)

    with pytest.raises(ConfigError, match=r"adapt_kwargs: maximun \(did you mean maximum\?\) is no parameter of LocalCluster.adapt"):
        load({"adapt_kwargs": {"minimum": 1, "maximun": 4}})
    slurm = {"cluster_class": "dask_jobqueue.SLURMCluster", "config_file": str(INFRA / "slurm.yaml")}
    with pytest.raises(ConfigError, match=r"adapt_kwargs: maximum_job \(did you mean maximum_jobs\?\) is no parameter of dask_jobqueue.SLURMCluster"):
        load(slurm | {"adapt_kwargs": {"maximum_job": 4}})
    with pytest.raises(ConfigError, match=r"needs integers 1 <= minimum_jobs <= maximum_jobs \(got minimum_jobs=0, maximum_jobs=4\)"):
        load(slurm | {"adapt_kwargs": {"minimum_jobs": 0, "maximum_jobs": 4}})
    with pytest.raises(ConfigError, match=r"1 <= minimum_jobs <= maximum_jobs \(got minimum_jobs=3, maximum_jobs=2\)"):
        load(slurm | {"adapt_kwargs": {"minimum_jobs": 3, "maximum_jobs": 2}})
    assert load(slurm | {"adapt_kwargs": {"minimum_jobs": 1, "maximum_jobs": 4, "interval": "5s"}}).dask.adapt_kwargs["maximum_jobs"] == 4
    assert load(slurm | {"adapt_kwargs": {"maximum_jobs": 20}}).dask.adapt_kwargs["maximum_jobs"] == 20  # dask-jobqueue's usage
    assert load(slurm | {"adapt_kwargs": {"minimum": 1, "maximum_jobs": 20}}).dask.adapt_kwargs["maximum_jobs"] == 20
    assert load({"adapt_kwargs": {"minimum": 1, "maximum": 3, "wait_count": 2, "target_duration": "10s",
                                  "maximum_memory": "8GB"}}).dask.adapt_kwargs["maximum"] == 3


def test_a_misspelt_jobqueue_setting_is_named_not_another_setting_whose_value_the_message_lists():
    """{config_name: slurm-gpu, quue: gpu} was reported as 'dask.cluster_kwargs.config_name:
    'slurm-gpu'': dask-jobqueue's message about the misspelt key lists every argument's value."""
    pytest.importorskip("dask_jobqueue", reason="dask-jobqueue is in the dev extra")
    from tasks.cluster import ClusterSettingError

    with pytest.raises(ClusterSettingError, match=r"^dask.cluster_kwargs.quue: 'gpu': SLURMCluster did not start: .*argument 'quue'"):
        with start_cluster("dask_jobqueue.SLURMCluster", {"config_name": "slurm-gpu", "quue": "gpu"},
                           dask_config=read_dask_config(INFRA / "slurm.yaml")):
            pass


def test_cluster_sizes_beside_a_scheduler_address_and_a_missing_config_file_are_refused_up_front(tmp_path):
    from flows.checks import check_inputs
    from flows.config import ConfigError, load_config

    base = {"name": "t", "store": str(tmp_path / "s.zarr"), "output_dir": str(tmp_path / "out")}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base | {"dask": {"scheduler_address": "tcp://127.0.0.1:8786", "n_workers": 8}}))
    with pytest.raises(ConfigError, match=r"n_workers size a cluster gpmil starts; with scheduler_address"):
        load_config(path)
    path.write_text(yaml.safe_dump(base | {"dask": {"config_file": "missing.yaml"}}))
    with pytest.raises(ConfigError, match=rf"dask.config_file: {tmp_path / 'missing.yaml'} does not exist"):
        load_config(path, preflight=lambda config: check_inputs(config, "train"))


def test_the_command_line_gives_the_temporary_prefect_server_time_to_start():
    """Prefect waits 20 s for its temporary server, whose first start takes 10–60 s on a loaded
    node: `gpmil run` failed with a raw 'Timed out while attempting to connect' traceback. The wait
    gpmil asks for is recorded by a stand-in for the server's start (nothing is started)."""
    import subprocess
    import sys

    code = ("import flows.cli as cli; from prefect.server.api.server import SubprocessASGIServer as S; "
            "S.start = lambda self, timeout=None: print('waits', timeout); cli._temporary_prefect_server_of_its_own()")
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")}
    waits = [subprocess.run([sys.executable, "-c", code], env=env | extra, capture_output=True, text=True, check=True).stdout.split()[-1]
             for extra in ({}, {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300"})]
    assert waits == ["120", "300"]  # at least 120 s; a longer setting of the user's holds


def test_a_misspelt_jobqueue_profile_is_refused_before_the_cluster_starts(tmp_path):
    """``config_name: slurm-gpus`` loaded fine and failed at cluster start with a bare KeyError."""
    from flows.checks import check_inputs
    from flows.config import ConfigError, load_config

    infra = Path(__file__).resolve().parents[1] / "infra"
    base = {"name": "t", "store": str(tmp_path / "s.zarr"), "output_dir": str(tmp_path / "out")}
    (tmp_path / "s.zarr").mkdir()
    path = tmp_path / "c.yaml"
    for name, error in (("slurm-gpus", r"no profile 'slurm-gpus' under jobqueue in .*slurm.yaml; did you mean 'slurm-gpu'\?"),
                        ("slurm-gpu", None), ("slurm", None)):  # the file's profile, dask-jobqueue's own
        path.write_text(yaml.safe_dump(base | {"dask": {"cluster_class": "dask_jobqueue.SLURMCluster", "config_file": str(infra / "slurm.yaml"),
                                                        "cluster_kwargs": {"config_name": name}}}))
        if error is None:
            load_config(path, preflight=lambda config: check_inputs(config, "train"))
        else:
            with pytest.raises(ConfigError, match=error):
                load_config(path, preflight=lambda config: check_inputs(config, "train"))
