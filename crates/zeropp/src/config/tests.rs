//! The flags -> configuration tests of `zeropp train`.

use super::*;
use zeropp_engine::config::{QgzConfig, ResidualPrecision};
use zeropp_engine::model::{GptConfig, MlpConfig};
use zeropp_run::train::ModelChoice;

use crate::models::model_choice;

/// `zeropp train ARGS` parsed into its flags.
fn flags(args: &[&str]) -> Result<TrainArgs, CliError> {
    #[derive(clap::Parser)]
    struct Cmd {
        #[command(flatten)]
        train: TrainArgs,
    }
    use clap::Parser as _;
    Ok(Cmd::try_parse_from(std::iter::once("train").chain(args.iter().copied()))?.train)
}

/// `zeropp train ARGS`'s configuration, as `run` builds it.
fn parse(args: &[&str]) -> Result<TrainConfig, CliError> {
    Ok(train_config(&flags(args)?)?.cfg)
}

#[test]
fn model_names_map_to_their_default_shapes() {
    assert!(matches!(model_choice("gpt"), Ok(ModelChoice::Gpt(g)) if g == GptConfig::default_small()));
    assert!(matches!(model_choice("GPT-Tiny"), Ok(ModelChoice::Gpt(g)) if g == GptConfig::tiny()));
    assert!(matches!(model_choice("mlp-small"), Ok(ModelChoice::Mlp(m)) if m == MlpConfig::default_small()));
    assert!(matches!(model_choice("mlp-tiny"), Ok(ModelChoice::Mlp(m)) if m == MlpConfig::tiny()));
    let err = model_choice("rnn").err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("unknown model `rnn`"), "{err}");
}

/// The default learning rate is 3e-3 (issue 26: the calm regime) from the
/// flags, from a DeepSpeed file that sets none, and the library's default.
#[test]
fn the_default_learning_rate_is_3e_3_everywhere() -> Result<(), CliError> {
    assert_eq!(TrainConfig::default().run.engine.optim.lr, 3e-3);
    assert_eq!(parse(&[])?.run.engine.optim.lr, 3e-3);
    let dir = std::env::temp_dir().join(format!("zeropp-lr-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let ds = dir.join("ds.json");
    std::fs::write(&ds, r#"{"train_batch_size": 16, "zero_optimization": {"stage": 3}}"#)
        .map_err(|e| e.to_string())?;
    let ds_arg = ds.to_string_lossy().into_owned();
    assert_eq!(
        parse(&["--config", &ds_arg])?.run.engine.optim.lr,
        3e-3,
        "a DeepSpeed file with no optimizer"
    );
    assert_eq!(parse(&["--config", &ds_arg, "--lr", "1e-3"])?.run.engine.optim.lr, 1e-3);
    let with_lr = dir.join("ds-lr.json");
    std::fs::write(&with_lr, r#"{"optimizer": {"type": "AdamW", "params": {"lr": 5e-4}}}"#)
        .map_err(|e| e.to_string())?;
    assert_eq!(parse(&["--config", &with_lr.to_string_lossy()])?.run.engine.optim.lr, 5e-4);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[test]
fn bucket_flags_map_onto_the_knobs() -> Result<(), CliError> {
    let k = parse(&[
        "--reduce-bucket-size",
        "4096",
        "--prefetch-bucket-size",
        "0",
        "--param-persistence-threshold",
        "100",
        "--max-live-parameters",
        "1000000",
    ])?
    .run
    .engine
    .zero
    .buckets;
    assert_eq!(
        (k.reduce_bucket_size, k.prefetch_bucket_size, k.param_persistence_threshold, k.max_live_parameters),
        (Some(4096), Some(0), 100, Some(1_000_000))
    );
    assert_eq!(parse(&[])?.run.engine.zero.buckets, Default::default());
    for (args, says) in [
        (&["--reduce-bucket-size", "0"][..], "--reduce-bucket-size"),
        (&["--max-live-parameters", "x"][..], "--max-live-parameters"),
    ] {
        let err = parse(args).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains(says), "{args:?}: {err}");
    }
    Ok(())
}

#[test]
fn gpt_shapes_parse_and_bad_keys_name_themselves() {
    let g = match model_choice("gpt:d=768,layers=12,heads=12,seq=256") {
        Ok(ModelChoice::Gpt(g)) => g,
        other => panic!("{other:?}"),
    };
    assert_eq!((g.d_model, g.n_layer, g.n_head, g.seq_len, g.mlp_ratio), (768, 12, 12, 256, 4));
    // A preset with an override keeps the rest of its shape.
    assert!(matches!(model_choice("gpt2-small:seq=256"),
        Ok(ModelChoice::Gpt(g)) if g == GptConfig { seq_len: 256, ..GptConfig::shape(768, 12, 12, 1024) }));
    crate::test_util::refused(
        model_choice,
        &[
            ("gpt:d=768,depth=3", "unknown key `depth`"),
            ("gpt:layers=x", "`layers=x` is not a positive integer"),
            ("gpt:heads=0", "`heads=0` is not a positive integer"),
            ("gpt:d=100,heads=3", "n_head 3 does not divide d_model 100"),
            ("gpt:seq=4096", "seq_len 4096 exceeds"),
            ("gpt:d", "`d` in `gpt:d` is not key=value"),
            ("mlp:d=3", "takes no shape"),
            ("gpt-7b", "unknown model `gpt-7b`"),
        ],
    );
    // The help lists every preset with its parameter count.
    let help = model_help();
    for (name, g) in GptConfig::presets() {
        let line = help.lines().find(|l| l.trim_start().starts_with(&format!("{name} "))).unwrap_or_default();
        assert!(line.contains(&format!("{:.2}M", g.with_vocab(256).num_params() as f64 / 1e6)), "{line}");
    }
}

/// `zeropp train ARGS`'s ZeRO switches.
fn zero(args: &[&str]) -> Result<ZeroConfig, CliError> {
    zero_from_flags(&flags(args)?)
}

#[test]
fn zeropp_flags_map_onto_the_config() -> Result<(), CliError> {
    let local = 4;
    // The default mode is ZeRO++ with its default options, routed hierarchically.
    let d = zero(&[])?;
    assert_eq!(d, ZeroConfig::zeropp(local));
    // No error feedback, the 1-D exclusion, stochastic rounding in qgZ only.
    assert!(d.error_feedback().is_none() && d.exclude_1d() && d.qgz_stochastic());
    assert!(!d.stochastic_rounding);
    assert_eq!(d.routing, zeropp_engine::config::Routing::Hierarchical);
    // `--no-error-feedback` is the default, kept for scripts.
    assert_eq!(zero(&["--no-error-feedback"])?, d);
    // The paper's plain variant.
    assert_eq!(zero(&["--qgz-nearest", "--no-qgz-exclude-1d"])?, ZeroConfig::zeropp_plain(local));
    // DeepSpeed's LoCo-ZeRO++, as the default was before.
    let loco_qgz = zero(&["--error-feedback", "--qgz-nearest"])?;
    assert_eq!(loco_qgz.qgz, Some(QgzConfig::loco(ZeroConfig::default_qgz_spec())));
    assert_eq!(zero(&["--qgz-nearest", "--qgz-stochastic"])?, d);
    // Routing, the hpZ wire, LoCo's parameters.
    assert_eq!(zero(&["--baseline", "flat"])?.routing, zeropp_engine::config::Routing::Flat);
    assert_eq!(zero(&["--hpz-wire", "int8"])?.hpz_wire, zeropp_engine::config::HpzWire::Int8);
    let loco = zero(&["--loco-beta", "0.5", "--loco-reset", "10"])?.error_feedback();
    assert_eq!(
        loco.map(|l| (l.err_beta, l.reset_t, l.residual_dtype)),
        Some((0.5, 10, ResidualPrecision::Bf16))
    );
    let f32_res = zero(&["--loco-residuals", "f32"])?.error_feedback();
    assert_eq!(f32_res.map(|l| l.residual_dtype), Some(ResidualPrecision::F32));
    // ZeRO-3 has no qgZ, so no qgZ options.
    let z3 = zero(&["--mode", "zero3"])?;
    assert!(z3.qgz.is_none() && z3.qwz.is_none());
    // Bad values are one-line errors naming the flag.
    for (args, says) in [
        (&["--baseline", "ring"][..], "--baseline"),
        (&["--hpz-wire", "int3"][..], "--hpz-wire"),
        (&["--no-error-feedback", "--loco-beta", "0.5"][..], "cannot be used with"),
        (&["--loco-residuals", "f16"][..], "--loco-residuals"),
    ] {
        let err = zero(args).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains(says), "{args:?}: {err}");
    }
    Ok(())
}

/// The `zeropp-delta` mode is the preset; its three switches turn on and off
/// one by one, on any mode, and their options need them on.
#[test]
fn sdp4bit_flags_map_onto_the_config() -> Result<(), CliError> {
    let local = 4;
    let p = zero(&["--mode", "zeropp-delta"])?;
    assert_eq!(p, ZeroConfig::zeropp_delta(local));
    assert_eq!(p.label(), "zeropp-delta");
    let q = |z: &ZeroConfig| z.qgz.map(|q| (q.two_level, q.hadamard));
    assert_eq!(q(&p), Some((true, true)));
    let off = zero(&["--mode", "zeropp-delta", "--no-qwz-delta", "--no-qgz-two-level", "--no-qgz-hadamard"])?;
    assert_eq!(off, ZeroConfig::zeropp(local));
    let on = zero(&["--qwz-delta", "--qgz-two-level", "--qgz-hadamard"])?;
    assert_eq!(on, p);
    let d = zero(&["--qwz-delta", "--qwz-delta-refresh", "7", "--qwz-delta-bits", "8"])?.qwz_delta;
    assert_eq!(d.map(|d| (d.refresh_every, d.spec.bits().bits())), Some((7, 8)));
    assert_eq!(q(&zero(&["--qgz-hadamard"])?), Some((false, true)));
    assert_eq!(zero(&["--qwz-delta"])?.label(), "zeropp+delta");
    for (args, says) in [
        (&["--qwz-delta-refresh", "5"][..], "need qwZ-delta"),
        (&["--no-qgz", "--qgz-hadamard"][..], "qgZ, which is off"),
        (&["--qwz-delta", "--qwz-delta-bits", "3"][..], "bits must be 4 or 8"),
    ] {
        let err = zero(args).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains(says), "{args:?}: {err}");
    }
    // What the engine refuses comes back through the configuration's check.
    let hpz1 = parse(&["--qwz-delta", "--hpz", "1"])?;
    let err = hpz1.run.engine.validate(8, 4).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("it needs hpZ"), "{err}");
    Ok(())
}

#[test]
fn fault_specs_parse() -> Result<(), CliError> {
    assert_eq!(parse_faults("fail:3:2")?.fail, Some((3, 2)));
    assert_eq!(parse_faults("nan:0:1")?.nan_gradient, Some((0, 1)));
    assert!(parse_faults("boom:1:1").is_err());
    assert!(parse_faults("fail:1").is_err());
    assert!(parse_faults("fail:x:1").is_err());
    Ok(())
}

/// One precedence, applied once: defaults (`--mode`) < DeepSpeed file < flags,
/// for every technique flag, not only the on/off switches.
#[test]
fn flags_win_over_the_deepspeed_file_which_wins_over_the_mode() -> Result<(), CliError> {
    let dir = std::env::temp_dir().join(format!("zeropp-precedence-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let ds = dir.join("ds.json");
    std::fs::write(
        &ds,
        r#"{"zero_optimization": {"stage": 3, "zero_quantized_weights": false,
            "zero_quantized_gradients": true, "zeropp_loco_param": {"err_beta": 0.6, "reset_T": 7}}}"#,
    )
    .map_err(|e| e.to_string())?;
    let file = ds.to_string_lossy().into_owned();
    let at = |extra: &[&str]| -> Result<ZeroConfig, CliError> {
        let args: Vec<&str> =
            ["--mode", "zeropp", "--config", &file].into_iter().chain(extra.iter().copied()).collect();
        Ok(parse(&args)?.run.engine.zero)
    };
    // The file over the mode: qwZ off, LoCo from the file.
    let z = at(&[])?;
    let loco = z.error_feedback().map(|l| (l.err_beta, l.reset_t));
    assert_eq!((z.qwz, loco), (None, Some((0.6, 7))));
    // Each flag over the file, the file's other settings kept.
    let z = at(&["--qwz", "--loco-beta", "0.3", "--qgz-bits", "8", "--qgz-two-level"])?;
    assert!(z.qwz.is_some());
    let q = z.qgz.ok_or("qgZ is on")?;
    assert_eq!((q.spec.bits().bits(), q.two_level), (8, true));
    assert_eq!(q.error_feedback.map(|l| (l.err_beta, l.reset_t)), Some((0.3, 7)));
    assert_eq!(at(&["--no-qgz"])?.qgz, None);
    assert!(at(&["--no-error-feedback"])?.error_feedback().is_none());
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
