"""The deployments the README and infra/prefect.yaml document, run for real: a Prefect server
started as `prefect server start` on a free loopback port (its own PREFECT_HOME and database in a
temporary folder), `gpmil serve CONFIG --cron …`, and a process work pool with a worker fed by
`prefect deploy --all --prefect-file infra/prefect.yaml`. Each run is triggered with
`run_deployment` and must complete with its artifacts and its outputs on disk."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import unquote, urlparse

import pandas as pd
import pytest
import yaml

from tests.conftest import make_toy_bags
from tests.test_distributed import write_store

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[1]
SERVER_START_TIMEOUT_S = 180
RUN_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """Background processes of the module (server, `gpmil serve`, worker) with their logs; stopped
    at the end, in reverse order."""

    def __init__(self, folder: Path, env: dict[str, str]):
        self.folder, self.env, self.started = folder, env, []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "w")
        process = subprocess.Popen(args, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.started.append((name, process, log))
        return process

    def run(self, *args: str, timeout: float = 120, unset: tuple[str, ...] = ()) -> str:
        env = {key: value for key, value in self.env.items() if key not in unset}
        done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{' '.join(args)} exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    def logs(self) -> str:
        return "\n".join(f"--- {name} ---\n{(self.folder / f'{name}.log').read_text()[-4000:]}" for name, _, _ in self.started)

    def stop(self, name: str | None = None) -> None:
        for entry in reversed(list(self.started)):
            process_name, process, log = entry
            if name is not None and process_name != name:
                continue
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(10)
            log.close()
            self.started.remove(entry)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`prefect server start` on a free loopback port; the test process and every subprocess talk to it."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    folder = tmp_path_factory.mktemp("prefect")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    inherited = {k: v for k, v in os.environ.items() if k not in ("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "DASK_LOGGING__DISTRIBUTED")}
    env = {**inherited, "PREFECT_HOME": str(folder / "home"), "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{folder / 'prefect.db'}",
           "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "GPMIL_HOME": str(ROOT)}
    processes = Processes(folder, env)
    processes.start("server", sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui")
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"{api}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        assert processes.started[0][1].poll() is None and time.monotonic() < deadline, f"no Prefect server\n{processes.logs()}"
        time.sleep(0.5)
    try:
        with temporary_settings({PREFECT_API_URL: api}):
            yield processes
    finally:
        processes.stop()


@pytest.fixture
def config(tmp_path):
    folder = tmp_path
    X, bags, y, _ = make_toy_bags(n_bags=16, seed=3)
    store = write_store(folder / "cohort.zarr", X, bags, y)
    path = folder / "toy.yaml"
    path.write_text(yaml.safe_dump({"name": "toy", "store": store, "output_dir": str(folder / "out"),
                                    "model": {"name": "VGPMIL", "params": {"n_inducing": 8, "max_iter": 5, "random_state": 0}},
                                    "dask": {"n_workers": 1, "processes": False}}))
    return path


def wait_for_deployment(name: str, processes: Processes, timeout: float = 180):
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            try:
                return client.read_deployment_by_name(name)
            except ObjectNotFound:
                assert time.monotonic() < deadline, f"no deployment {name}\n{processes.logs()}"
                time.sleep(0.5)


def run_and_check(name: str, processes: Processes, parameters: dict | None = None):
    """Run a deployment to completion; its flow run and artifacts."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment

    flow_run = run_deployment(name, parameters=parameters, timeout=RUN_TIMEOUT_S)
    assert flow_run.state is not None and flow_run.state.is_completed(), f"{name}: {flow_run.state}\n{processes.logs()}"
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    return flow_run, artifacts


def assert_pipeline_outputs(config: Path, artifacts) -> Path:
    out = Path(yaml.safe_load(config.read_text())["output_dir"])
    [report] = out.glob("predictions/*/report.md")
    assert len(pd.read_parquet(report.with_name("bag_predictions.parquet"))) == 16 and report.with_name("roc.png").is_file()
    assert [m.name for m in out.glob("models/*/model.json")]
    kinds = {(a.type, a.key) for a in artifacts}  # a link artifact is Markdown holding the link
    assert {("markdown", "report-toy"), ("table", "metrics-toy"), ("markdown", "report-file-toy"), ("markdown", "dask-dashboard-toy"),
            ("progress", "training-toy"), ("image", "figure-toy-roc"), ("image", "figure-toy-objective")} <= kinds, kinds
    links = {a.key: a.data for a in artifacts if a.key in ("report-file-toy", "dask-dashboard-toy")}
    assert report.as_uri() in links["report-file-toy"] and "http://" in links["dask-dashboard-toy"]
    markdown = next(a.data for a in artifacts if a.key == "report-toy")
    assert report.with_name("roc.png").as_uri() in markdown and "base64" not in markdown
    images = [Path(unquote(urlparse(a.data).path)) for a in artifacts if a.type == "image"]
    assert sorted(images) == sorted([report.with_name("objective.png"), report.with_name("roc.png"), *report.parent.glob("*/*.png")])
    return report


def wait_for_scheduled_runs(deployment_id, processes: Processes, timeout: float = 60) -> list:
    """The flow runs the server's scheduler service has put on a deployment's schedule."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                                         flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))))
            if runs:
                return runs
            assert time.monotonic() < deadline, f"the scheduler put no run on the schedule\n{processes.logs()}"
            time.sleep(1)


def test_gpmil_serve_registers_a_scheduled_deployment_whose_runs_complete(server, config):
    from zoneinfo import ZoneInfo

    server.start("serve", sys.executable, "-m", "flows.cli", "serve", str(config), "--cron", "0 2 * * *", "--timezone", "Europe/Berlin")
    deployment = wait_for_deployment("gpmil-pipeline/gpmil-toy", server)
    assert [(s.schedule.cron, s.schedule.timezone) for s in deployment.schedules] == [("0 2 * * *", "Europe/Berlin")]
    assert deployment.parameters == {"config": str(config.resolve())}
    # The cron puts runs on the schedule (with SQLAlchemy 2.1 the server's scheduler failed every loop and no run ever came),
    # at 2 am in Berlin (1 am UTC in winter, midnight in summer), not at 2 am UTC.
    scheduled = [run.expected_start_time.astimezone(ZoneInfo("Europe/Berlin")) for run in wait_for_scheduled_runs(deployment.id, server)]
    assert all((start.hour, start.minute) == (2, 0) for start in scheduled) and all(start.utcoffset().total_seconds() > 0 for start in scheduled)
    try:
        flow_run, artifacts = run_and_check("gpmil-pipeline/gpmil-toy", server)
        assert_pipeline_outputs(config, artifacts)
    finally:
        server.stop("serve")
    console = (server.folder / "serve.log").read_text()
    assert "is being served" in console and "| INFO" not in console and "distributed." not in console  # chatter only with -v


def test_sigterm_during_a_run_stops_gpmil_serve_with_its_schedule_paused(server, config):
    """systemd or a batch scheduler stops a service with SIGTERM: Prefect's handler left the schedule
    active when a run was under way, and its runs piled up as Late with nothing serving them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment

    serve = server.start("serve2", sys.executable, "-m", "flows.cli", "serve", str(config), "--cron", "0 3 * * *")
    deployment = wait_for_deployment("gpmil-pipeline/gpmil-toy", server)
    flow_run = run_deployment("gpmil-pipeline/gpmil-toy", timeout=0)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    with get_client(sync_client=True) as client:
        while (state := client.read_flow_run(flow_run.id).state_type) not in (StateType.PENDING, StateType.RUNNING):
            assert state == StateType.SCHEDULED and time.monotonic() < deadline, f"{state}\n{server.logs()}"  # not yet taken up
            time.sleep(0.2)
        serve.send_signal(signal.SIGTERM)  # to the serving process alone (systemd sends it first), the run in its hands
        assert serve.wait(RUN_TIMEOUT_S) is not None
        assert client.read_deployment(deployment.id).paused, server.logs()
    server.stop("serve2")


def test_prefect_yaml_deployments_run_on_a_process_work_pool(server, config, tmp_path):
    server.run(sys.executable, "-m", "prefect", "work-pool", "create", "gpmil-pool", "--type", "process")
    # as documented, GPMIL_HOME unset where it is deployed: set there, Prefect stored the deploying shell's path
    output = server.run(sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file", "infra/prefect.yaml",
                        timeout=180, unset=("GPMIL_HOME",))
    documented = [d["name"] for d in yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())["deployments"]]
    assert all(f"'{flow}/{name}' successfully created" in " ".join(output.split())
               for flow, name in zip(["gpmil-pipeline", "predict-cohort"], documented)), output
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        stored = client.read_deployment_by_name("gpmil-pipeline/nightly-pipeline").pull_steps
    assert stored == [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $GPMIL_HOME }}"}}]  # the worker's
    server.start("worker", sys.executable, "-m", "prefect", "worker", "start", "--pool", "gpmil-pool", "--type", "process")

    nightly, artifacts = run_and_check("gpmil-pipeline/nightly-pipeline", server, {"config": str(config)})
    report = assert_pipeline_outputs(config, artifacts)

    X, bags, y, _ = make_toy_bags(n_bags=6, seed=11)
    new = write_store(tmp_path / "new-cohort.zarr", X, bags, y)
    model_dir = next((Path(yaml.safe_load(config.read_text())["output_dir"]) / "models").iterdir())
    # `latest`, as infra/prefect.yaml gives it: the nightly run's model
    predicted, _ = run_and_check("predict-cohort/predict-new-cohort", server, {"config": str(config), "model_dir": "latest", "store": new})
    assert predicted.parameters["store"] == new and report.exists()
    import zarr

    from tasks.training import read_predictions

    [key] = list(zarr.open_group(new, mode="r")["predictions"].group_keys())
    assert read_predictions(new, key)["bags/proba"].shape == (6,)
    assert zarr.open_group(new, mode="r")["predictions"][key].attrs["model_key"] == model_dir.name
