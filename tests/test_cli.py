import json

from vlforge.cli import main


def test_data_synth_and_check_commands(tmp_path, capsys):
    assert main(["data", "synth", "shapes", "--n", "20", "--out", str(tmp_path), "--seed", "1",
                 "--tasks", "colour,count"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert {r["task"] for r in rows} == {"colour", "count"} and len(rows) == 18
    capsys.readouterr()
    assert main(["data", "check", str(tmp_path / "train.jsonl"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid_rows"] == 18 and report["errors"] == 0 and report["images"] == 18
    (tmp_path / "bad.jsonl").write_text('{"image": "missing.png", "text": "q", "answer": "a"}\n')
    assert main(["data", "check", str(tmp_path / "bad.jsonl")]) == 1
    assert "bad.jsonl:1" in capsys.readouterr().out


def test_errors_are_one_line_not_tracebacks(tmp_path, capsys):
    assert main(["sft", str(tmp_path / "nope.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {preset: tiny}\ntrain: {bacth_size: 2}\n")
    assert main(["sft", str(cfg)]) == 2
    assert "did you mean 'batch_size'" in capsys.readouterr().err
    cfg.write_text("model: {preset: tiny}\n")
    assert main(["sft", str(cfg), f"train.output_dir={tmp_path / 'run'}", "train.device=cpu"]) == 2
    assert "data.train is not set" in capsys.readouterr().err


def test_print_config_shows_effective_values(capsys):
    assert main(["sft", "configs/demo-sft.yaml", "optim.weight_decay=0.5", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "weight_decay: 0.5" in out and "preset: tiny" in out


def test_options_may_follow_overrides_and_bad_presets_are_named(tmp_path, capsys, shapes_dir):
    # the README's form: FILE --config CFG key=value
    assert main(["data", "check", str(shapes_dir / "val.jsonl"), "--config", "configs/demo-sft.yaml",
                 "data.max_length=64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_length"] == 64
    assert main(["sft", "configs/demo-sft.yaml", "model.preset=huge", "--plan"]) == 2
    assert "unknown model.preset 'huge'" in capsys.readouterr().err


def test_grpo_plan_and_json_needs_plan(capsys):
    assert main(["grpo", "configs/demo-grpo.yaml", "--plan", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["trainable_params"] > 0 and plan["modules"] and "precision" in plan
    assert main(["sft", "configs/demo-sft.yaml", "--json"]) == 2  # not a silent training run
    assert "--json goes with --plan" in capsys.readouterr().err


def test_plan_and_run_log_count_lora_parameters_alike(tmp_path, capsys, shapes_dir):
    """The run's 'training X of Y parameters' line equals --plan's counts (LoRA adapters counted once)."""
    args = ["sft", "configs/demo-sft.yaml", "tiers.method=lora", f"data.train={shapes_dir / 'train.jsonl'}",
            "data.val=null", "train.max_steps=1", "train.batch_size=2", "log.progress=false", "train.device=cpu",
            f"train.output_dir={tmp_path / 'run'}"]
    assert main(args + ["--plan", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    assert f"training {plan['trainable_params']:,} of {plan['total_params']:,} parameters" in capsys.readouterr().out


def test_demo_overwrite_replaces_only_an_earlier_demo(tmp_path):
    import pytest

    from vlforge.config import ConfigError
    from vlforge.demo import demo_dir

    (tmp_path / "sft").mkdir()
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="notes.txt"):
        demo_dir(str(tmp_path), overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "sft").is_dir()
    (tmp_path / "notes.txt").unlink()
    assert demo_dir(str(tmp_path), overwrite=True) == tmp_path and not any(tmp_path.iterdir())


def test_a_bad_data_file_is_refused_before_the_model_loads_or_the_run_starts(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    for command, config in (("sft", "configs/demo-sft.yaml"), ("grpo", "configs/demo-grpo.yaml")):
        # a model.path that does not exist: loading it first would fail with another message
        assert main([command, config, f"data.train={tmp_path / 'empty.jsonl'}", "model.path=/nonexistent/model",
                     f"train.output_dir={tmp_path / 'run'}"]) == 2
        err = capsys.readouterr().err
        assert "empty.jsonl" in err and "no rows" in err and "model.path" not in err
        assert not (tmp_path / "run").exists()  # nothing written either


def test_eval_checks_its_out_file_before_any_work(tmp_path, capsys, shapes_dir):
    (tmp_path / "file").write_text("")
    for out, message in ((tmp_path / "file" / "x.json", "does not exist"), (tmp_path, "is a directory")):
        # a model source that does not exist: the --out check must come first
        assert main(["eval", str(tmp_path / "no-model"), "--data", str(shapes_dir / "val.jsonl"),
                     "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
