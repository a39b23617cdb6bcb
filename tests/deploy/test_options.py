"""What a deployment is made of, without a cluster: `DeployOptions` from ``serve run`` arguments and from the CLI,
the errors naming a bad value, the Serve deployment they build (placement group, scaling, drain, router, job
directory), each rank's environment, the router's choice and the merged metrics."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from xstage_dit.cli import build_parser
from xstage_dit.cli.serve import _config
from xstage_dit.deploy import Autoscaling, DeployOptions
from xstage_dit.deploy.application import DEPLOYMENT, ROUTER, app, deployment_options
from xstage_dit.deploy.metrics import merge
from xstage_dit.deploy.ranks import rank_envs
from xstage_dit.deploy.router import ready_candidates
from xstage_dit.errors import UsageError


def test_serve_run_arguments_become_typed_options():
    o = DeployOptions.from_args({"model": "tiny-flux", "sp": "2", "replicas": "3", "gpus_per_rank": "0",
                                 "max_batch_size": "1", "warmup": "false", "batching": "never",
                                 "request_timeout_s": "90", "collective_timeout_s": "120"})
    assert (o.replicas, o.gpus_per_rank, o.world_size, o.autoscaling) == (3, 0.0, 2, None)
    assert (o.server.max_batch_size, o.server.warmup, o.server.batching) == (1, False, "never")
    assert o.server.parallel.timeout_s == 120.0 and o.graceful_s == 120.0  # the request timeout + 30 s
    scaled = DeployOptions.from_args({"model": "tiny-flux", "min_replicas": 1, "max_replicas": "4",
                                      "target_ongoing_requests": "3"})
    assert scaled.autoscaling == Autoscaling(min_replicas=1, max_replicas=4, target_ongoing_requests=3.0)


@pytest.mark.parametrize("args, message", [
    ({"modle": "x"}, "modle: unknown argument"),
    ({"sp": "two"}, "sp: expected an integer, got 'two'"),
    ({"warmup": "maybe"}, "warmup: expected true or false, got 'maybe'"),
    ({"replicas": "2", "max_replicas": "3"}, "replicas: expected replicas or min_replicas/max_replicas"),
    ({"target_ongoing_requests": "3"}, "target_ongoing_requests: expected min_replicas or max_replicas"),
    ({"min_replicas": "0"}, "min_replicas: expected an integer >= 1"),
    ({"min_replicas": "2", "max_replicas": "1"}, "max_replicas: expected an integer >= min_replicas (2), got 1"),
    ({"replicas": "0"}, "replicas: expected an integer >= 1, got 0"),
    ({"cpus_per_rank": "0"}, "cpus_per_rank: expected a number > 0, got 0.0"),
    ({"max_batch_size": "0"}, "max_batch_size: expected an integer >= 1, got 0"),
    ({"dtype": "int8"}, "dtype: expected one of"),
])
def test_bad_arguments_are_named(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DeployOptions.from_args({"model": "tiny-flux", **args})


def _cli(*argv: str):
    args = build_parser().parse_args(["serve", *argv])
    from xstage_dit.cli.serve_replicas import options, wanted

    return wanted(args), options(args, _config(args))


def test_the_cli_builds_the_same_options():
    wanted, o = _cli("--model", "tiny-flux", "--sp", "2", "--replicas", "2", "--gpus-per-rank", "0",
                     "--max-batch-size", "1", "--no-warmup")
    assert wanted and (o.replicas, o.world_size, o.gpus_per_rank, o.server.max_batch_size) == (2, 2, 0.0, 1)
    assert o.server.warmup is False and o.engine["compile_guards"] == "full" and o.engine["features"] == {}
    _, scaled = _cli("--min-replicas", "1", "--max-replicas", "3", "--downscale-delay", "60")
    assert scaled.autoscaling.max_replicas == 3 and scaled.autoscaling.downscale_delay_s == 60.0
    assert not _cli("--model", "tiny-flux")[0]


@pytest.mark.parametrize("argv, message", [
    (("--ray-address", "auto"), "--ray-address: expected --replicas or --min-replicas/--max-replicas with it"),
    (("--replicas", "2", "--max-replicas", "3"), "--replicas: expected --replicas or --min-replicas/--max-replicas"),
    (("--min-replicas", "1", "--downscale-delay", "-1"), "--downscale-delay: expected a number >= 0, got -1.0"),
    (("--replicas", "0"), "--replicas: expected an integer >= 1, got 0"),
])
def test_bad_cli_options_are_named(argv, message):
    with pytest.raises(UsageError, match=message):
        _cli(*argv)


def test_the_deployment_packs_each_replica_and_drains_it():
    o = DeployOptions.from_args({"model": "tiny-flux", "sp": "2", "cfg": "2", "replicas": "3", "cpus_per_rank": "4",
                                 "max_queue": "10", "max_batch_size": "2"})
    opts = deployment_options(o)
    assert opts["name"] == DEPLOYMENT and opts["num_replicas"] == 3 and "autoscaling_config" not in opts
    assert opts["placement_group_bundles"] == [{"CPU": 4.0, "GPU": 1.0}] * 4
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["ray_actor_options"] == {"num_cpus": 4.0, "num_gpus": 1.0}  # rank 0 fits bundle 0
    assert opts["max_ongoing_requests"] == 10 + 2 + 64 and opts["graceful_shutdown_timeout_s"] == o.graceful_s
    scaled = DeployOptions(autoscaling=Autoscaling(min_replicas=1, max_replicas=2), gpus_per_rank=0)
    opts = deployment_options(scaled)
    assert "num_replicas" not in opts and opts["autoscaling_config"]["max_replicas"] == 2
    assert opts["placement_group_bundles"] == [{"CPU": 1.0}]


def test_serve_run_builder_makes_an_application_with_the_router_and_the_directory():
    application = app({"model": "tiny-flux", "sp": "2", "replicas": "2", "gpus_per_rank": "0"})
    deployment = application._bound_deployment
    config = deployment._deployment_config
    assert deployment.name == DEPLOYMENT and config.num_replicas == 2
    assert config.request_router_config.request_router_class == ROUTER
    assert [a.name for a in config.deployment_actors] == ["jobs"]
    bound = deployment.init_args[0]
    assert bound.replicas == 1 and bound.autoscaling is None  # scaling is deployment config, not init args


def test_rank_environments_share_the_replicas_gpus():
    envs = rank_envs([{"node": "n", "gpus": ["5"]}, {"node": "n", "gpus": ["3"]}], port=29500)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,5", "3,5"]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [("0", "1", "2"), ("1", "0", "2")]
    assert all(e["MASTER_ADDR"] == "127.0.0.1" and e["MASTER_PORT"] == "29500" for e in envs)
    assert all(e["NCCL_NVLS_ENABLE"] == "0" and "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES" not in e for e in envs)
    shared = rank_envs([{"node": "n", "gpus": ["0"]}, {"node": "n", "gpus": ["0"]}], port=1)
    assert all(e["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] == "1" for e in shared)
    cpu = rank_envs([{"node": "n", "gpus": []}] * 3, port=1)
    assert [e["LOCAL_RANK"] for e in cpu] == ["0", "1", "2"] and all("CUDA_VISIBLE_DEVICES" not in e for e in cpu)
    ten = rank_envs([{"node": "n", "gpus": [str(g)]} for g in (10, 2)], port=1)
    assert ten[0]["CUDA_VISIBLE_DEVICES"] == "2,10" and ten[0]["LOCAL_RANK"] == "1"
    with pytest.raises(ValueError, match="one node"):
        rank_envs([{"node": "a", "gpus": []}, {"node": "b", "gpus": []}], port=1)
    with pytest.raises(ValueError, match="a GPU for every rank"):
        rank_envs([{"node": "a", "gpus": ["0"]}, {"node": "a", "gpus": []}], port=1)


class FakeReplica:
    def __init__(self, unique_id: str, ready: bool | None):
        self.replica_id = argparse.Namespace(unique_id=unique_id)
        self.routing_stats = {} if ready is None else {"ready": ready}


def test_the_router_prefers_ready_replicas_and_honours_a_retrys_exclusion():
    a, b, c = FakeReplica("a", True), FakeReplica("b", False), FakeReplica("c", None)  # c: no stats yet
    assert ready_candidates([a, b, c], None) == [a, c]
    assert ready_candidates([a, b, c], "a") == [c]
    assert ready_candidates([b], None) == [b]  # none ready: the proxy's request still goes (503 at once)
    assert ready_candidates([a, b], "a") == []  # a retry waits for a ready replica other than its own


def test_metrics_of_several_replicas_merge_per_family_with_a_replica_label():
    a = "# HELP x_depth Depth.\n# TYPE x_depth gauge\nx_depth 1.0\n# TYPE x_req counter\nx_req_total{code=\"200\"} 3.0\n"
    b = "# HELP x_depth Depth.\n# TYPE x_depth gauge\nx_depth 2.0\n"
    text = merge({"r2": b, "r1": a}).decode()
    assert text.count("# TYPE x_depth gauge") == 1
    assert 'x_depth{replica="r1"} 1.0' in text and 'x_depth{replica="r2"} 2.0' in text
    assert 'x_req_total{code="200",replica="r1"} 3.0' in text


def test_the_kuberay_manifests_application_arguments_are_valid():
    import yaml

    manifest = yaml.safe_load((Path(__file__).resolve().parents[2] / "docs" / "kuberay-rayservice.yaml").read_text())
    application = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]
    assert application["import_path"] == "xstage_dit.deploy:app"
    o = DeployOptions.from_args(application["args"])
    assert o.world_size == 4 and o.autoscaling.max_replicas == 4 and o.gpus_per_rank == 1.0
    workers = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert int(workers["resources"]["limits"]["nvidia.com/gpu"]) == o.world_size * o.gpus_per_rank  # a pod a replica
