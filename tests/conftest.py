"""Shared fixtures: the embedded tiny tokenizer and a randomly initialised tiny Qwen2."""
import contextlib
import os
import subprocess
import sys
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("TQDM_DISABLE", "1")
# Ray reads this when imported: a local Ray then binds 127.0.0.1 (tests stay on loopback)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("WANDB_SILENT", "true")


def worker_threads(env, cpus=None) -> dict:
    """The thread count for one of ``make test-fast``'s pytest processes (pytest-xdist names their number
    in ``PYTEST_XDIST_WORKER_COUNT``): its share of the cores this process may use, at least 1, unless
    ``OMP_NUM_THREADS`` is given. Two processes of torch's default two threads each on two cores spent
    twice the CPU of one process (302 CPU-s against 147) and ran longer (175 s against 148); at one
    thread each, 96 s. ``{}`` outside pytest-xdist: one process keeps torch's default."""
    workers = int(env.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers <= 1 or "OMP_NUM_THREADS" in env:
        return {}
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
    return {"OMP_NUM_THREADS": str(max(1, cpus // workers))}


os.environ.update(worker_threads(os.environ))  # before torch is imported: it reads the variable once
# a job's trainers, generators, reward workers, reference and critics are kept for a later job of the same shape
# (cluster.ray_wing.pool): a new actor's imports cost 6-8 s of CPU, most of a short test job.
# tests/cluster/test_kept_actors.py shows a job on kept actors computes what it computes on new ones; the first
# job of each shape starts new actors.
os.environ.setdefault("RAYRL_REUSE_ACTORS", "1")
# Ray's own upkeep, inherited by every Ray process a test starts (the shared Ray, simulated nodes, a `ray start`
# head) and read by its log monitor and dashboard agent. The monitor lists the session's log files at least every
# 0.1 s while there are fewer than 1000 (the run makes hundreds; past 1000 Ray lists them every 0.5 s): now every
# 5 s, so a new worker's lines reach a driver up to 5 s late, none lost. The agent samples every worker process
# every 5 s: now every 60 s (nothing here reads those samples). The two together, 40 idle actors for a minute:
# 3.55 CPU-s before, 1.81 after (one run of each).
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "1")
os.environ.setdefault("LOG_NAME_UPDATE_INTERVAL_S", "5")
os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")


RAY_CPUS = 16  # logical CPUs of the test run's Ray: room for the largest job's actors (they share 2 cores)


def ray_up():
    """The test run's one local Ray, started on first use (and again after a test that shut it down,
    as the tests of starting and leaving Ray do): loopback, quiet, the checkout on every actor's path.
    Its variables reach the actors as the environment of Ray's own processes, as ``start_ray`` sets
    them, so actors take the worker processes Ray starts ahead. Each job or cluster removes its actors
    and placement groups when it ends, or keeps its trainers, generators, reward workers, reference and
    critics for a later cluster of their shape (``RAYRL_REUSE_ACTORS``, below); the next one joins this Ray
    (``start_ray`` joins a running one). Its workers are forked from a process that has imported torch,
    transformers and DeepSpeed once (``tests/zygote.py``)."""
    import ray

    if not ray.is_initialized():
        from tests.zygote import ray_workers_forked

        with ray_workers_forked(ray_env()):
            ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False)
    return ray


def ray_env() -> dict:
    """The variables the tests give the Ray they start (and so its actors), and the zygote that forks
    its workers (``tests/zygote.py``): both must see the same ones. ``OMP_NUM_THREADS`` as Ray gives a
    one-CPU worker; every actor sets its own thread count at start (``setup_process``)."""
    path = os.environ.get("PYTHONPATH", "")
    if path.split(os.pathsep)[0] != ROOT:  # once, when called inside a block that set it
        path = ROOT + os.pathsep + path
    return {"PYTHONPATH": path, "TQDM_DISABLE": "1",
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def pytest_sessionfinish(session, exitstatus):
    if "ray" in sys.modules:
        sys.modules["ray"].shutdown()
    from rl_actors.scratch import sweep
    from tests import zygote

    zygote.stop()
    sweep()  # what the run's last actors left (a vLLM worker's directory: its cluster swept while it was going)


def pytest_terminal_summary(terminalreporter):
    from tests import zygote

    if zygote.started():
        terminalreporter.write_line(f"tests/zygote.py: {zygote.summary()}")


def run_job(args: list):
    """``rayrl <args>`` (e.g. ``["rl", "job.yaml", "--algorithm.steps", "2"]``) through the
    command-line entry point, on the test run's Ray (``ray_up``); its summary."""
    from cluster.jobs.cli import run

    ray_up()
    return run(list(args))


@pytest.fixture(scope="session")
def tokenizer():
    from primitives.fixtures.tiny import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    from primitives.fixtures.tiny import TinyModelSpec, build_tiny_model

    model = build_tiny_model(tokenizer, TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2),
                             seed=1)
    model.eval()
    return model


@pytest.fixture(scope="module")
def ray_local():
    """The test run's Ray (``ray_up``), for a module of tests that start actors. The actors the last
    jobs kept (``RAYRL_REUSE_ACTORS``) stay across the module boundary: a cluster takes the groups of
    its shapes, and frees the oldest of the others only as far as its own bundles need the room
    (``cluster.ray_wing.pool``). Actors a test starts by hand reserve no CPU, or one."""
    return ray_up()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """The embedded tiny model saved in HF format (random init)."""
    from primitives.fixtures.tiny import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"), seed=0)


def scored_rollouts(path, num_prompts=4, n=4, seed=0):
    """Rollouts of the tiny model on arithmetic prompts, scored by exact match."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from primitives.env.rewards import score_rollouts
    from primitives.fixtures.tasks import ArithmeticTaskSpec, arithmetic_reward, make_arithmetic_task
    from primitives.model.generation import generate_rollouts
    from primitives.types import GenerationConfig

    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    items = make_arithmetic_task(ArithmeticTaskSpec(num_train=num_prompts, num_heldout=1, seed=seed))[0]
    rs = generate_rollouts(model, tok, items, GenerationConfig(max_new_tokens=4, n=n),
                           generator=torch.Generator().manual_seed(seed))
    # a reward that varies with the sampled tokens, so groups have spread (a random model
    # never gets a sum right, and always fills max_new_tokens)
    return score_rollouts(rs, lambda r: float(int(r.completion_ids.sum()) % 3) + arithmetic_reward(r)), tok


def lora_numel(path, rank):
    """Parameters of rank-``rank`` adapters on every linear layer but the output head of the model at
    ``path``, counted by hand: ``rank * (in + out)`` each (a second computation of what PEFT builds)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    head = model.get_output_embeddings()
    return sum(rank * (m.in_features + m.out_features) for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m is not head)


def pytest_collection_modifyitems(config, items):
    """A test on the run's Ray fixture is a Ray test (``-m "not ray"`` leaves it out); a module or test
    that starts Ray by other means carries the ``ray`` mark itself.

    Tests marked ``own_ray`` shut the run's Ray down (a simulated cluster of their own, a real head
    for ``ray job submit``, a check that no Ray is left running): they run last, in their order, so
    that Ray, and the actors kept from job to job, serve every other test of the run. Each shutdown
    in the middle of the run cost the Ray's start and new processes for every actor shape after it.

    Before them run the modules with a test that starts from the default task's SFT'd policy (``sft_policy``),
    whole (their module fixtures set up once): under ``make test`` the tier beside makes that policy in the time
    the Ray tests leave idle (``make_shared_ahead``), so the Ray tests ask for it as late as they can."""
    for item in items:
        if "ray_local" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)

    def module(item) -> str:
        return item.nodeid.split("::")[0]

    late = {module(item) for item in items if "sft_policy" in getattr(item, "fixturenames", ())}
    own = [item for item in items if item.get_closest_marker("own_ray")]
    rest = [item for item in items if not item.get_closest_marker("own_ray")]
    items[:] = [item for item in rest if module(item) not in late] + [item for item in rest if module(item) in late] \
        + own


@pytest.fixture(autouse=True, scope="session")
def no_ray_in_the_fast_tier():
    """``make test-fast`` (RAYRL_FAST_TESTS=1) runs the tests without the ``ray`` mark: one that starts
    Ray anyway fails at once, naming the mark it lacks, so the fast tier stays fast and Ray-free."""
    if os.environ.get("RAYRL_FAST_TESTS"):
        import ray

        def refuse(*args, **kwargs):
            raise RuntimeError("make test-fast: this test starts Ray; give it (or its module) the mark "
                               "pytest.mark.ray")

        ray.init = refuse
    yield


DEFAULT_JOB = os.path.join(ROOT, "examples", "configs", "default.yaml")
# the default task as the tests that start from its SFT'd policy run it: 128 held-out problems (the shipped 256 take
# twice the evaluations), demonstrations with the carry dropped in 70 % of carry problems (as shipped)
DEFAULT_TASK = {"num_heldout": 128, "carry_error_rate": 0.7}


@pytest.fixture(scope="session")
def sft_policy(tmp_path_factory):
    """The default task's SFT'd policy: the default job's SFT stage (1500 steps, as shipped) on the tests' task
    (``DEFAULT_TASK``), an HF directory (``made_default_policy``). Under ``make test`` the tier beside the Ray tests
    has made it, or is making it, in ``$RAYRL_TEST_SHARED``; else it is made here."""
    return made_default_policy(os.path.join(shared_root(tmp_path_factory, "default_sft"), "default_policy"))


@pytest.fixture(scope="session")
def tool_caller(tmp_path_factory):
    """tool_use.yaml's SFT stage alone, once per test run for the tool tests (the job file's in
    ``test_config_scenarios``, ``examples/tool_use.py``'s in ``test_scenarios``): a model that calls the
    tools, an HF directory (``made_tool_caller``). Made as ``sft_policy`` is."""
    return made_tool_caller(os.path.join(shared_root(tmp_path_factory, "tool_sft"), "tool_caller"))


def shared_root(tmp_path_factory, name: str) -> str:
    """Where a model the tiers of ``make test`` use is made: ``$RAYRL_TEST_SHARED``, else a fresh directory."""
    from tests.suite import SHARED_ENV

    return os.environ.get(SHARED_ENV) or str(tmp_path_factory.mktemp(name))


def made_default_policy(path: str) -> str:
    """The default job's SFT stage at ``path``, as shipped (1500 steps of 64 at lr 1e-3, 50 warm-up steps, its
    seed) on ``DEFAULT_TASK``, trained in one process (``made_sft_policy``). Its losses are the job's two ZeRO-2
    ranks' within 1e-6 for the first 50 steps, but the stage's loss sits near 0.93 from step 200 to 500 and then
    falls, which magnifies the ranks' different rounding: greedy accuracy on the 128 held-out problems 0.547 from
    this policy, 0.680 from the ranks' (2026-11-30). Every test from it asks for a rise, not a level."""
    return made_sft_policy(path, DEFAULT_JOB, {}, DEFAULT_TASK)


def made_tool_caller(path: str) -> str:
    """The tool caller at ``path``: 150 SFT steps at lr 1e-2 in batches of 16 (the shipped stage is 1000 at 3e-3 in
    32s) of tool_use.yaml's SFT stage (``made_sft_policy``). After 150 steps the RL runs' rollouts called a tool
    0.81 to 1.0 times each, and 81 to 100 % of the calls succeeded (after 300: 1.0 calls; the tests ask for more
    than 0)."""
    return made_sft_policy(path, os.path.join(ROOT, "examples", "configs", "tool_use.yaml"),
                           {"steps": 150, "batch": 16, "lr": 1e-2})


def made_sft_policy(path: str, config: str, sft: dict, task_kwargs=None) -> str:
    """The SFT stage of the job file ``config`` (its ``sft`` section's fields replaced by ``sft``, its task's
    arguments by ``task_kwargs``) at ``path``, made once however many processes ask (``primitives.files.made_once``):
    the job's own SFT samples through the job's own SFT stage (``train_sft_stage``), in this process. A Ray trainer
    group computes the same update (the SFT tests of 1 rank against N hold it), and here it costs no cluster start
    and no second rank's share of the work. Saved in HF form for the RL runs. Returns the policy's directory.
    At one torch thread, as the tier beside runs it: the same policy however the tests are run (a stage whose
    rounding grows, as the default one's does, would otherwise start the tests elsewhere under one pytest)."""
    from primitives.files import made_once

    def write(tmp: str) -> None:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            train(tmp)
        finally:
            torch.set_num_threads(threads)

    def train(tmp: str) -> None:
        from cluster.jobs.config import load_job_config
        from cluster.jobs.inputs import prepare_rl
        from cluster.jobs.rl import train_sft_stage
        from cluster.local import LocalBackend
        from primitives.types import TrainState

        job = load_job_config(config)
        data = job.data if task_kwargs is None else job.data._replace(task_kwargs=dict(task_kwargs))
        job = job._replace(sft=job.sft._replace(**sft), data=data, eval=job.eval._replace(enabled=False),
                           logging=job.logging._replace(out=os.path.join(tmp, "run")))
        inputs = prepare_rl(job)
        backend = LocalBackend(inputs.job.model, inputs.reward_fn, seed=job.seed)
        train_sft_stage(backend, inputs, logger=lambda metrics: None)
        backend.save(os.path.join(tmp, "sft"), TrainState())

    policy = ("sft", "policy", "config.json")
    made_once(path, write, lambda p: os.path.isfile(os.path.join(p, *policy)))
    return os.path.join(path, *policy[:2])


# the architectures the run's vLLM engines load: the tiny model's (primitives/fixtures/tiny.py) and SmolLM2's
VLLM_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")


def vllm_model_infos(architectures=VLLM_ARCHITECTURES, timeout_s: float = 600) -> None:
    """vLLM's model information for ``architectures``, in its cache (``$VLLM_CACHE_ROOT/modelinfos``, one file each).
    An engine that finds none there inspects the model's class in a Python subprocess of its own that imports vLLM:
    33 s of the first vLLM job of each architecture in a test run here (52 s against 19 s with the cache), in the
    Ray tests' foreground. Asked here, in a subprocess (vLLM stays out of this pytest), it is made beside them.
    That subprocess inspects the classes itself: vLLM would start one more per class, each importing vLLM and torch
    again, only to keep CUDA out of the asking process, which here is a subprocess of its own on the CPU."""
    script = ("import sys\nfrom vllm.model_executor.models import registry\n"
              "registry._run_in_subprocess = lambda fn: fn()\n"
              "for arch in sys.argv[1:]:\n    registry.ModelRegistry.models[arch].inspect_model_cls()\n")
    done = subprocess.run([sys.executable, "-c", script, *architectures], capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's model information: {done.stderr.strip()[-500:]}")


_DESELECTED: list = []  # the tests this pytest collected and left to another tier (or to -k)


def pytest_deselected(items):
    _DESELECTED.extend(items)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    if not session.config.option.collectonly:  # --collect-only runs no test
        make_shared_ahead(session.items, _DESELECTED)


def make_shared_ahead(here: list, elsewhere: list) -> None:
    """In ``make test``'s tier beside the Ray tests (``$RAYRL_TEST_SHARED`` given, Ray refused), before its
    own tests: make what the Ray tier's fixtures would otherwise make in its foreground, in the time it
    leaves idle (this process runs in the idle scheduling class), where a test of the run asks for it
    (``here``: this tier's tests; ``elsewhere``: those it collected and left to the others). The tool
    caller (35 s of one process here, first asked for about 4 minutes in), the embedded SmolLM2's
    conversion (about 10 s) and vLLM's information on the run's model classes (``vllm_model_infos``, about
    48 s; both wherever the other tiers have tests: jobs load them by name, no fixture asks), and the
    default task's SFT'd policy (130 s of one process; the modules that start from it run last in the Ray
    tier, ``pytest_collection_modifyitems``). A Ray-tier fixture that asks sooner waits for it, and
    while it waits the cores are this process's. Made or not, the tests go on: a fixture makes what is
    missing. A run of a few Ray-free paths makes none of them."""
    from tests.suite import FAST_ENV, SHARED_ENV

    root = os.environ.get(SHARED_ENV)
    if not root or not os.environ.get(FAST_ENV):
        return
    asked = {name for item in [*here, *elsewhere] for name in getattr(item, "fixturenames", ())}

    def smollm2() -> None:
        from cluster.jobs.inputs import resolve_model
        from primitives.types import ModelConfig

        resolve_model(ModelConfig("smollm2"), "", seed=0)

    makers = [("tool_caller" in asked, lambda: made_tool_caller(os.path.join(root, "tool_caller"))),
              (bool(elsewhere), smollm2),
              (bool(elsewhere), vllm_model_infos),
              ("sft_policy" in asked, lambda: made_default_policy(os.path.join(root, "default_policy")))]
    for wanted, make in makers:
        if not wanted:
            continue
        try:
            make()
        except Exception as error:  # the fixture makes it then, and names what fails
            print(f"tests/conftest.py: not made ahead ({error!r}); the tests that need it make it", flush=True)


@contextlib.contextmanager
def local_http_server(handler):
    """An ``http.server.HTTPServer`` with ``handler`` on a free loopback port, served from a thread:
    yields the server (``server.server_port``), shut down after."""
    from http.server import HTTPServer

    server = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
