//! The DeepSpeed reader's unit tests.
use super::*;

#[test]
fn inconsistent_batch_is_an_error() {
    let j =
        r#"{"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}"#;
    let e = from_json_str(j, 8, &EngineConfig::default()).unwrap_err();
    assert!(e.to_string().contains("train_batch_size 30"), "{e}");
}

#[test]
fn micro_and_accum_give_the_global_batch() {
    let j = r#"{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
               "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}},
               "gradient_clipping": 0.5, "bf16": {"enabled": false}, "fancy": 1}"#;
    let imp = from_json_str(j, 4, &EngineConfig::default()).unwrap();
    assert_eq!(imp.config.global_batch, 24);
    assert_eq!(imp.config.grad_accum, 3);
    assert_eq!(imp.config.optim.beta1, 0.8);
    assert_eq!(imp.config.gradient_clipping, Some(0.5));
    assert_eq!(imp.config.zero.comm_dtype, CommDtype::F32);
    assert_eq!(imp.warnings, vec!["unknown key `fancy` was ignored".to_string()]);
}

#[test]
fn loco_params_are_imported() {
    let j = r#"{"zero_optimization": {"stage": 3, "zero_quantized_gradients": true,
               "zeropp_loco_param": {"err_beta": 0.6, "reset_T": 512}}}"#;
    let imp = from_json_str(j, 4, &EngineConfig::default()).unwrap();
    assert_eq!(
        imp.config.zero.error_feedback(),
        Some(zeropp_engine::config::LocoConfig { err_beta: 0.6, reset_t: 512, ..Default::default() })
    );
    assert!(imp.warnings.is_empty(), "{:?}", imp.warnings);
    let bad = r#"{"zero_optimization": {"zeropp_loco_param": {"err_beta": "high"}}}"#;
    assert!(from_json_str(bad, 4, &EngineConfig::default()).is_err());
}

#[test]
fn bucket_knobs_are_imported_and_bad_values_name_the_key() {
    let text = r#"{"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1000000000}}"#;
    let imp = from_json_str(text, 8, &EngineConfig::default()).unwrap();
    assert!(imp.warnings.is_empty(), "{:?}", imp.warnings);
    let k = imp.config.zero.buckets;
    assert_eq!(k.reduce_bucket_size, Some(500_000_000));
    assert_eq!(k.prefetch_bucket_size, Some(0));
    assert_eq!(k.param_persistence_threshold, 100_000);
    assert_eq!(k.max_live_parameters, Some(1_000_000_000));
    for (bad, says) in [
        (r#"{"zero_optimization": {"reduce_bucket_size": -1}}"#, "zero_optimization.reduce_bucket_size"),
        (r#"{"zero_optimization": {"reduce_bucket_size": 0}}"#, "zero_optimization.reduce_bucket_size"),
        (r#"{"zero_optimization": {"stage3_prefetch_bucket_size": 1.5}}"#, "stage3_prefetch_bucket_size"),
        (r#"{"zero_optimization": {"stage3_max_live_parameters": "lots"}}"#, "stage3_max_live_parameters"),
    ] {
        let err =
            from_json_str(bad, 8, &EngineConfig::default()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains(says), "{bad}: {err}");
    }
}

#[test]
fn unsupported_values_are_errors() {
    for j in [
        r#"{"zero_optimization": {"stage": 2}}"#,
        r#"{"fp16": {"enabled": true}}"#,
        r#"{"optimizer": {"type": "SGD"}}"#,
        r#"{"train_batch_size": "many"}"#,
        r#"[1, 2]"#,
        "not json",
    ] {
        assert!(from_json_str(j, 2, &EngineConfig::default()).is_err(), "{j}");
    }
}

/// Nested keys are named by their dotted path, in errors and in the "auto"
/// warnings alike; `null` and `"auto"` leave the value as it was.
#[test]
fn nested_keys_are_named_by_their_path() {
    let err = |j: &str| from_json_str(j, 4, &EngineConfig::default()).err().map(|e| e.to_string());
    for (bad, key) in [
        (r#"{"optimizer": {"params": {"lr": "fast"}}}"#, "`optimizer.params.lr`"),
        (
            r#"{"zero_optimization": {"zeropp_loco_param": {"reset_T": -1}}}"#,
            "`zero_optimization.zeropp_loco_param.reset_T`",
        ),
        (
            r#"{"zero_optimization": {"zero_quantized_weights": 1}}"#,
            "`zero_optimization.zero_quantized_weights`",
        ),
        (r#"{"bf16": {"enabled": "yes"}}"#, "`bf16.enabled`"),
    ] {
        let e = err(bad).unwrap_or_default();
        assert!(e.contains(key), "{bad}: {e}");
    }
    let j = r#"{"optimizer": {"params": {"lr": "auto", "eps": null}},
               "zero_optimization": {"zero_quantized_gradients": true,
                                     "zeropp_loco_param": {"err_beta": "auto", "reset_T": 7}}}"#;
    let base = EngineConfig::default();
    let imp = from_json_str(j, 4, &base).unwrap();
    assert_eq!((imp.config.optim.lr, imp.config.optim.eps), (base.optim.lr, base.optim.eps));
    let loco = imp.config.zero.error_feedback().unwrap();
    assert_eq!((loco.err_beta, loco.reset_t), (zeropp_engine::config::LocoConfig::default().err_beta, 7));
    assert_eq!(imp.warnings.len(), 2, "{:?}", imp.warnings);
    assert!(imp.warnings[0].starts_with("`optimizer.params.lr`: \"auto\""), "{:?}", imp.warnings);
    assert!(
        imp.warnings[1].starts_with("`zero_optimization.zeropp_loco_param.err_beta`"),
        "{:?}",
        imp.warnings
    );
}
