"""Config files stay flat and keep loading: every config shipped in docs/results, a deploy's config.json, and the
full flat key set earlier versions wrote; the same keys nested by section give the same config."""
import json
from pathlib import Path

import pytest

from edgekv.runtime.config import SECTIONS, ConfigError, RuntimeConfig
from edgekv.runtime.solutions import load_deployed

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"

# every key (and default) the flat RuntimeConfig of earlier versions wrote into config.json
FLAT_V1 = {"G": 4, "M": 100, "sigma": 8.0, "C": 200, "max_kv_mem_mib": None, "max_batch": 4, "max_context": 32768,
           "reuse": True, "rolling_buffer": True, "sink_tokens": 0, "window_tokens": 0, "selector": "lowrank",
           "score_reduce": "sum", "adapter_path": None, "klr_dtype": "bfloat16", "reader_backend": "auto",
           "io_align_bytes": 4096, "io_queue_depth": 64, "kv_record_dtype": "auto", "importance_rate": 0.2,
           "beta": 1.0, "score_block_tokens": 1024, "arkv_quant": "auto", "arkv_gamma": 263.81,
           "arkv_window_tokens": 32, "arkv_slack": 0.75, "ttft_costs_path": None, "clustering": False,
           "cluster_queries": 32, "recluster_steps": 8, "cluster_radius": 0.3, "replica_share": 0.05,
           "replacement": "fifo", "max_request_bytes": 262144, "share_prefix": True, "verify_fraction": 1.0,
           "read_deadline_s": 60.0}


# the keys added since, each at a default under which an earlier config runs as before
ADDED_SINCE_V1 = {"correction": "guess", "correction_reads": None, "correction_overlap": False, "slot_memory": "device",
                  "decode_cpu_threads": None, "correction_recall": 1.0, "guess_from_before": False, "io_gap_bytes": 0,
                  "prompt_adapter": False}


def test_the_flat_key_set_of_earlier_versions_loads_and_writes_back_unchanged():
    config = RuntimeConfig.load(FLAT_V1)
    assert config.to_dict() == {**FLAT_V1, **ADDED_SINCE_V1}
    assert sorted(RuntimeConfig.keys()) == sorted([*FLAT_V1, *ADDED_SINCE_V1])
    assert (config.io.reader_backend, config.predictor.klr_dtype, config.arkv.arkv_slack) == ("auto", "bfloat16", 0.75)


def test_every_config_shipped_in_docs_results_loads():
    from edgekv.evals.harness import recorded_configs

    loaded = [RuntimeConfig.load(RESULTS / "serving" / "serve-smollm2-config.json")]
    for path in sorted(RESULTS.rglob("*.json")):
        data = json.loads(path.read_text())
        rows = (data.get("results") or data.get("ppl") or []) if isinstance(data, dict) else []
        for row in rows:
            if isinstance(row, dict) and isinstance(row.get("config"), dict):
                flat = {k: v for k, v in row["config"].items() if k in RuntimeConfig.keys()}
                loaded.append(RuntimeConfig.load(flat))
        if path.name.startswith(("eval-", "ppl-", "chosen-")):
            loaded += [RuntimeConfig.load(c) for c in recorded_configs(path).values()]
    assert len(loaded) > 50


def test_a_deployed_config_written_by_deploy_loads(tmp_path):
    deployed = {**FLAT_V1, "platform": "local", "model": "fixture", "max_batch": 2, "max_context": 512,
                "solutions": [{"batch": 2, "context": 512, "G": 4, "M": 8, "C": 16, "sigma": 4, "reuse": True}]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(deployed))
    base, solutions = load_deployed(str(path))
    assert base.max_context == 512 and solutions.pick(2, 512).M == 8


def test_nested_sections_give_the_same_config_as_flat_keys():
    flat = {"G": 8, "reader_backend": "python", "klr_dtype": "int8", "clustering": True, "verify_fraction": 0.5,
            "beta": 2.0, "arkv_window_tokens": 16, "ttft_costs_path": "x.json"}
    nested = {"G": 8, "io": {"reader_backend": "python"}, "predictor": {"klr_dtype": "int8"},
              "placement": {"clustering": True}, "integrity": {"verify_fraction": 0.5}, "hillinfer": {"beta": 2.0},
              "arkv": {"arkv_window_tokens": 16}, "prefill": {"ttft_costs_path": "x.json"}}
    assert RuntimeConfig.load(nested) == RuntimeConfig.load(flat)
    assert set(SECTIONS) == {"io", "predictor", "placement", "integrity", "hillinfer", "arkv", "prefill"}


@pytest.mark.parametrize("config, named", [
    ({"io": {"klr_dtype": "int8"}}, r"section 'io' has no field\(s\) \['klr_dtype'\]"),
    ({"reader_backend": "python", "io": {"reader_backend": "auto"}}, r"\['reader_backend'\] given both flat and in section 'io'"),
    ({"io": 5}, r"section 'io' must be a mapping"),
    ({"io": {"io_align_bytes": 1000}}, r"'io_align_bytes' must be a power of two >= 512"),
    ({"io": {"max_request_bytes": 1024}}, r"'max_request_bytes' must be an integer >= io_align_bytes \(4096\)"),
    ({"selector": "psychic"}, r"'selector' must be one of \('lowrank', 'oracle', 'random'\)"),
])
def test_a_bad_section_or_field_is_named(config, named):
    with pytest.raises(ConfigError, match=named):
        RuntimeConfig.load(config)


def test_a_profile_with_the_old_solver_alpha_loads_with_a_warning_naming_the_new_key(tmp_path, caplog):
    import logging

    import yaml

    from edgekv.install.profile import PROFILES_DIR, ProfileError, load_profile

    data = yaml.safe_load((PROFILES_DIR / "local.yaml").read_text())
    data["solver"]["alpha"] = data["solver"].pop("exposed_io_share") * 2
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    with caplog.at_level(logging.WARNING, logger="edgekv"):
        assert load_profile(path).exposed_io_share == data["solver"]["alpha"]
    assert "'solver.alpha' is now 'solver.exposed_io_share'" in caplog.text
    data["solver"]["exposed_io_share"] = 0.3
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match="'solver.alpha' .* and 'solver.exposed_io_share' .* are one field"):
        load_profile(path)


def test_a_recorded_configuration_runs_again_with_its_reuse_buffer_replacement(tmp_path):
    """An eval or bench given ``--configs-from`` runs the recorded replacement, not the default fifo."""
    from edgekv.evals.harness import recorded_configs

    config = {"G": 4, "M": 8, "C": 10, "sigma": 2.0, "reuse": True, "replacement": "cost", "io_gap_bytes": 6720}
    row = {"policy": "kvswap", "budget": 1 / 6, "variant": "kvswap@1/6", "context": 8192, "config": config}
    (tmp_path / "chosen.json").write_text(json.dumps({"ppl": [row]}))
    assert recorded_configs(tmp_path / "chosen.json")[(8192, "1/6")]["replacement"] == "cost"
