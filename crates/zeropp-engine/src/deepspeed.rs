//! A reader for DeepSpeed JSON configurations, so DeepSpeed users can bring theirs.
//!
//! The supported keys are mapped onto [`EngineConfig`]:
//!
//! | DeepSpeed key | engine field |
//! |---|---|
//! | `train_batch_size` | `global_batch` |
//! | `train_micro_batch_size_per_gpu` | (checked: `global_batch / (world * grad_accum)`) |
//! | `gradient_accumulation_steps` | `grad_accum` |
//! | `gradient_clipping` | `gradient_clipping` |
//! | `bf16.enabled` | `zero.comm_dtype` (`true` = bf16, `false` = f32) |
//! | `optimizer.type` (`AdamW`/`Adam`), `optimizer.params.{lr,betas,eps,weight_decay}` | `optim` |
//! | `zero_optimization.stage` | `zero.stage` (only 3) |
//! | `zero_optimization.zero_quantized_weights` | `zero.qwz` (on: the base's spec, or INT8 in groups of 256) |
//! | `zero_optimization.zero_hpz_partition_size` | `zero.hpz_size` |
//! | `zero_optimization.zero_quantized_gradients` | `zero.qgz` (on: the base's qgZ, or INT4 in groups of 256 without options) |
//! | `zero_optimization.zeropp_loco_param.{err_beta,reset_T}` | `zero.qgz.error_feedback` (LoCo; ignored, with a warning, when qgZ is off) |
//! | `zero_optimization.{reduce_bucket_size, stage3_prefetch_bucket_size, stage3_param_persistence_threshold, stage3_max_live_parameters}` | `zero.buckets` ([`BucketKnobs`](crate::config::BucketKnobs); integers or integral numbers such as `5e8`) |
//!
//! Keys DeepSpeed knows but this engine does not model (the all-gather bucket size, overlap
//! switches, logging) are reported as warnings; unknown keys are warnings too.
//! Wrong types, unsupported values (stage 1, `fp16.enabled`, another optimizer)
//! and inconsistent batch arithmetic are errors.

use serde_json::{Map, Value};

use crate::EngineError;
use crate::config::{CommDtype, EngineConfig, ZeroConfig};

/// The result of reading a DeepSpeed config: the engine configuration and the
/// keys that were not applied.
#[derive(Debug, Clone, PartialEq)]
pub struct DeepSpeedImport {
    /// The configuration with the DeepSpeed values applied.
    pub config: EngineConfig,
    /// One line per ignored or unknown key.
    pub warnings: Vec<String>,
}

/// Top-level keys DeepSpeed defines that have no effect here (reported as warnings).
const IGNORED_TOP: &[&str] = &[
    "steps_per_print",
    "wall_clock_breakdown",
    "dump_state",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "communication_data_type",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comms_logger",
    "activation_checkpointing",
    "memory_breakdown",
    "seq_parallel_communication_data_type",
];

/// `zero_optimization` keys DeepSpeed defines that have no effect here.
const IGNORED_ZERO: &[&str] = &[
    "overlap_comm",
    "contiguous_gradients",
    "reduce_scatter",
    "allgather_partitions",
    "allgather_bucket_size",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "sub_group_size",
    "round_robin_gradients",
    "offload_param",
    "offload_optimizer",
    "memory_efficient_linear",
    "mics_shard_size",
];

fn type_err(key: &str, want: &str, got: &Value) -> EngineError {
    EngineError::InvalidConfig(format!("DeepSpeed config: `{key}` must be {want}, got {got}"))
}

/// Reads a positive integer; `"auto"` (Hugging Face style) is reported and skipped.
fn opt_usize(
    obj: &Map<String, Value>,
    key: &str,
    warnings: &mut Vec<String>,
) -> Result<Option<usize>, EngineError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s == "auto" => {
            warnings
                .push(format!("`{key}`: \"auto\" is not resolved by zeropp; using the command-line value"));
            Ok(None)
        }
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 => Ok(Some(n as usize)),
            _ => Err(type_err(key, "a positive integer", v)),
        },
    }
}

/// Reads a bucket knob: a non-negative integer (an integral number such as
/// `5e8` too, as DeepSpeed configs write them); `"auto"` is reported and skipped.
fn opt_elements(
    obj: &Map<String, Value>,
    key: &str,
    warnings: &mut Vec<String>,
) -> Result<Option<usize>, EngineError> {
    let full = format!("zero_optimization.{key}");
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s == "auto" => {
            warnings.push(format!("`{full}`: \"auto\" is not resolved by zeropp; using the default"));
            Ok(None)
        }
        Some(v) => match (v.as_u64(), v.as_f64()) {
            (Some(n), _) => Ok(Some(n as usize)),
            (None, Some(x)) if x >= 0.0 && x.fract() == 0.0 && x < 9.0e15 => Ok(Some(x as usize)),
            _ => Err(type_err(&full, "a non-negative integer (elements)", v)),
        },
    }
}

fn opt_f32(
    obj: &Map<String, Value>,
    key: &str,
    warnings: &mut Vec<String>,
) -> Result<Option<f32>, EngineError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s == "auto" => {
            warnings.push(format!("`{key}`: \"auto\" is not resolved by zeropp; using the default"));
            Ok(None)
        }
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() => Ok(Some(x as f32)),
            _ => Err(type_err(key, "a finite number", v)),
        },
    }
}

fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, EngineError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(type_err(key, "true or false", v)),
    }
}

fn as_object<'a>(key: &str, v: &'a Value) -> Result<&'a Map<String, Value>, EngineError> {
    v.as_object().ok_or_else(|| type_err(key, "an object", v))
}

/// Resolves DeepSpeed's batch triple for `world` ranks into `(global_batch, grad_accum)`.
///
/// Any of the three may be missing; the given ones must satisfy
/// `train_batch_size = micro * grad_accum * world`.
pub fn resolve_batch(
    train_batch_size: Option<usize>,
    micro: Option<usize>,
    grad_accum: Option<usize>,
    world: usize,
) -> Result<Option<(usize, usize)>, EngineError> {
    let w = world.max(1);
    let bad = |msg: String| Err(EngineError::InvalidConfig(format!("DeepSpeed config: {msg}")));
    match (train_batch_size, micro, grad_accum) {
        (None, None, None) => Ok(None),
        (Some(t), Some(m), Some(g)) => {
            if t != m * g * w {
                return bad(format!(
                    "train_batch_size {t} != train_micro_batch_size_per_gpu {m} x gradient_accumulation_steps {g} x world {w}"
                ));
            }
            Ok(Some((t, g)))
        }
        (Some(t), Some(m), None) => {
            if t % (m * w) != 0 {
                return bad(format!(
                    "train_batch_size {t} is not divisible by train_micro_batch_size_per_gpu {m} x world {w}"
                ));
            }
            Ok(Some((t, t / (m * w))))
        }
        (Some(t), None, g) => {
            let g = g.unwrap_or(1);
            if t % (g * w) != 0 {
                return bad(format!(
                    "train_batch_size {t} is not divisible by gradient_accumulation_steps {g} x world {w}"
                ));
            }
            Ok(Some((t, g)))
        }
        (None, Some(m), g) => {
            let g = g.unwrap_or(1);
            Ok(Some((m * g * w, g)))
        }
        (None, None, Some(_)) => {
            bad("gradient_accumulation_steps alone does not fix the batch: also give train_batch_size or train_micro_batch_size_per_gpu".into())
        }
    }
}

/// Parses DeepSpeed JSON text and applies it on top of `base` for `world` ranks.
///
/// ```
/// use zeropp_engine::config::EngineConfig;
/// use zeropp_engine::deepspeed::from_json_str;
/// let json = r#"{
///   "train_batch_size": 32, "gradient_accumulation_steps": 2,
///   "bf16": {"enabled": true},
///   "zero_optimization": {"stage": 3, "zero_quantized_weights": true,
///     "zero_hpz_partition_size": 4, "zero_quantized_gradients": true,
///     "overlap_comm": true}
/// }"#;
/// let imp = from_json_str(json, 8, &EngineConfig::default())?;
/// assert_eq!(imp.config.global_batch, 32);
/// assert_eq!(imp.config.micro_batch(8)?, 2);
/// assert!(imp.config.zero.qwz.is_some() && imp.config.zero.qgz.is_some());
/// assert_eq!(imp.warnings.len(), 1); // overlap_comm is not modelled
/// # Ok::<(), zeropp_engine::EngineError>(())
/// ```
pub fn from_json_str(text: &str, world: usize, base: &EngineConfig) -> Result<DeepSpeedImport, EngineError> {
    let root: Value = serde_json::from_str(text)
        .map_err(|source| EngineError::Json { what: "DeepSpeed config is not valid JSON", source })?;
    let obj = as_object("<root>", &root)?;
    let mut warnings = Vec::new();
    let mut cfg = base.clone();
    // The ZeRO++ switches and LoCo are applied after the loop, whatever the key order.
    let (mut qwz_on, mut qgz_on, mut loco_param) = (None, None, None);

    for (key, value) in obj {
        match key.as_str() {
            "train_batch_size" | "train_micro_batch_size_per_gpu" | "gradient_accumulation_steps" => {}
            "gradient_clipping" => {
                if let Some(c) = opt_f32(obj, key, &mut warnings)? {
                    if c < 0.0 {
                        return Err(type_err(key, "a number >= 0", value));
                    }
                    cfg.gradient_clipping = if c > 0.0 { Some(c) } else { None };
                }
            }
            "bf16" => {
                let b = as_object(key, value)?;
                for k in b.keys() {
                    if k != "enabled" {
                        warnings.push(format!("`bf16.{k}` is not supported and was ignored"));
                    }
                }
                match opt_bool(b, "enabled")? {
                    Some(true) => cfg.zero.comm_dtype = CommDtype::Bf16,
                    Some(false) => cfg.zero.comm_dtype = CommDtype::F32,
                    None => {}
                }
            }
            "fp16" => {
                let f = as_object(key, value)?;
                if opt_bool(f, "enabled")? == Some(true) {
                    return Err(EngineError::InvalidConfig(
                        "DeepSpeed config: fp16.enabled is not supported (zeropp trains with bf16 or f32 communication and f32 master weights); use bf16".into(),
                    ));
                }
            }
            "optimizer" => {
                let o = as_object(key, value)?;
                for k in o.keys() {
                    if k != "type" && k != "params" {
                        warnings.push(format!("`optimizer.{k}` is not supported and was ignored"));
                    }
                }
                let ty = match o.get("type") {
                    Some(Value::String(s)) => s.to_ascii_lowercase(),
                    Some(v) => return Err(type_err("optimizer.type", "a string", v)),
                    None => "adamw".into(),
                };
                let is_adam = match ty.as_str() {
                    "adamw" => false,
                    "adam" => true,
                    other => {
                        return Err(EngineError::InvalidConfig(format!(
                            "DeepSpeed config: optimizer `{other}` is not supported (only AdamW and Adam)"
                        )));
                    }
                };
                if is_adam {
                    // DeepSpeed's Adam defaults to decoupled weight decay (adam_w_mode=True).
                    cfg.optim.weight_decay = 0.0;
                }
                if let Some(p) = o.get("params") {
                    let p = as_object("optimizer.params", p)?;
                    for (pk, pv) in p {
                        match pk.as_str() {
                            "lr" => {
                                if let Some(v) = opt_f32(p, pk, &mut warnings)? {
                                    cfg.optim.lr = v;
                                }
                            }
                            "eps" => {
                                if let Some(v) = opt_f32(p, pk, &mut warnings)? {
                                    cfg.optim.eps = v;
                                }
                            }
                            "weight_decay" => {
                                if let Some(v) = opt_f32(p, pk, &mut warnings)? {
                                    cfg.optim.weight_decay = v;
                                }
                            }
                            "betas" => {
                                let arr = pv.as_array().filter(|a| a.len() == 2);
                                let betas: Option<Vec<f32>> = arr
                                    .map(|a| a.iter().filter_map(|x| x.as_f64().map(|x| x as f32)).collect());
                                match betas.as_deref() {
                                    Some([b1, b2]) => {
                                        cfg.optim.beta1 = *b1;
                                        cfg.optim.beta2 = *b2;
                                    }
                                    _ => {
                                        return Err(type_err("optimizer.params.betas", "[beta1, beta2]", pv));
                                    }
                                }
                            }
                            other => warnings
                                .push(format!("`optimizer.params.{other}` is not supported and was ignored")),
                        }
                    }
                }
            }
            "zero_optimization" => {
                let z = as_object(key, value)?;
                for (zk, zv) in z {
                    match zk.as_str() {
                        "stage" => match zv.as_u64() {
                            Some(3) => cfg.zero.stage = 3,
                            Some(s) => {
                                return Err(EngineError::InvalidConfig(format!(
                                    "DeepSpeed config: zero_optimization.stage {s} is not supported (only stage 3)"
                                )));
                            }
                            None => return Err(type_err("zero_optimization.stage", "an integer", zv)),
                        },
                        "zero_quantized_weights" => {
                            qwz_on = opt_bool(z, zk)?;
                        }
                        "zero_quantized_gradients" => {
                            qgz_on = opt_bool(z, zk)?;
                        }
                        "zeropp_loco_param" => {
                            let lp = as_object("zero_optimization.zeropp_loco_param", zv)?;
                            let mut loco = crate::config::LocoConfig::default();
                            for (lk, lv) in lp {
                                match lk.as_str() {
                                    "err_beta" => match lv.as_f64() {
                                        Some(b) => loco.err_beta = b as f32,
                                        None => {
                                            return Err(type_err(
                                                "zero_optimization.zeropp_loco_param.err_beta",
                                                "a number",
                                                lv,
                                            ));
                                        }
                                    },
                                    "reset_T" => match lv.as_u64() {
                                        Some(t) => loco.reset_t = t as usize,
                                        None => {
                                            return Err(type_err(
                                                "zero_optimization.zeropp_loco_param.reset_T",
                                                "a non-negative integer",
                                                lv,
                                            ));
                                        }
                                    },
                                    other => warnings.push(format!(
                                        "unknown key `zero_optimization.zeropp_loco_param.{other}` was ignored"
                                    )),
                                }
                            }
                            loco_param = Some(loco);
                        }
                        "zero_hpz_partition_size" => {
                            if let Some(n) = opt_usize(z, zk, &mut warnings)? {
                                cfg.zero.hpz_size = n;
                            }
                        }
                        "reduce_bucket_size" => {
                            if let Some(n) = opt_elements(z, zk, &mut warnings)? {
                                if n == 0 {
                                    return Err(type_err(
                                        "zero_optimization.reduce_bucket_size",
                                        "a positive integer (elements)",
                                        zv,
                                    ));
                                }
                                cfg.zero.buckets.reduce_bucket_size = Some(n);
                            }
                        }
                        "stage3_prefetch_bucket_size" => {
                            if let Some(n) = opt_elements(z, zk, &mut warnings)? {
                                cfg.zero.buckets.prefetch_bucket_size = Some(n);
                            }
                        }
                        "stage3_param_persistence_threshold" => {
                            if let Some(n) = opt_elements(z, zk, &mut warnings)? {
                                cfg.zero.buckets.param_persistence_threshold = n;
                            }
                        }
                        "stage3_max_live_parameters" => {
                            if let Some(n) = opt_elements(z, zk, &mut warnings)? {
                                cfg.zero.buckets.max_live_parameters = Some(n);
                            }
                        }
                        k if IGNORED_ZERO.contains(&k) => {
                            warnings.push(format!(
                                "`zero_optimization.{k}` is not modelled by zeropp and was ignored"
                            ));
                        }
                        k => warnings.push(format!("unknown key `zero_optimization.{k}` was ignored")),
                    }
                }
            }
            "scheduler" => {
                warnings.push("`scheduler` is not supported: zeropp uses a constant learning rate".into())
            }
            k if IGNORED_TOP.contains(&k) => {
                warnings.push(format!("`{k}` is not modelled by zeropp and was ignored"))
            }
            k => warnings.push(format!("unknown key `{k}` was ignored")),
        }
    }

    match qwz_on {
        Some(true) => cfg.zero.qwz = Some(cfg.zero.qwz.unwrap_or_else(ZeroConfig::default_qwz_spec)),
        Some(false) => cfg.zero.qwz = None,
        None => {}
    }
    match qgz_on {
        Some(true) => cfg.zero.qgz = Some(cfg.zero.qgz.unwrap_or_default()),
        Some(false) => cfg.zero.qgz = None,
        None => {}
    }
    if let Some(loco) = loco_param {
        match &mut cfg.zero.qgz {
            Some(q) => q.error_feedback = Some(loco),
            None => warnings.push(
                "`zero_optimization.zeropp_loco_param` has no effect with qgZ off and was ignored".into(),
            ),
        }
    }

    let tbs = opt_usize(obj, "train_batch_size", &mut warnings)?;
    let micro = opt_usize(obj, "train_micro_batch_size_per_gpu", &mut warnings)?;
    let gas = opt_usize(obj, "gradient_accumulation_steps", &mut warnings)?;
    if let Some((global, accum)) = resolve_batch(tbs, micro, gas, world)? {
        cfg.global_batch = global;
        cfg.grad_accum = accum;
    }
    Ok(DeepSpeedImport { config: cfg, warnings })
}

/// Reads a DeepSpeed JSON file (see [`from_json_str`]).
pub fn from_file(
    path: &std::path::Path,
    world: usize,
    base: &EngineConfig,
) -> Result<DeepSpeedImport, EngineError> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| EngineError::Io { path: path.to_path_buf(), source })?;
    from_json_str(&text, world, base)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inconsistent_batch_is_an_error() {
        let j = r#"{"train_batch_size": 30, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}"#;
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
            Some(crate::config::LocoConfig { err_beta: 0.6, reset_t: 512, ..Default::default() })
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
            (
                r#"{"zero_optimization": {"stage3_max_live_parameters": "lots"}}"#,
                "stage3_max_live_parameters",
            ),
        ] {
            let err = from_json_str(bad, 8, &EngineConfig::default())
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
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
}
