//! The two sections of a DeepSpeed config that carry structure: `optimizer`
//! (AdamW / Adam and its params) and `zero_optimization` (stage 3, the ZeRO++
//! switches, LoCo, hpZ and the bucket knobs).

use serde_json::{Map, Value};

use super::json::{as_object, opt_bool, opt_elements, opt_f32, opt_usize, type_err};
use crate::EngineError;
use crate::config::{AdamWConfig, LocoConfig, ZeroConfig};

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

/// Applies `optimizer` (`o`) to `optim`.
pub(super) fn optimizer(
    o: &Map<String, Value>,
    optim: &mut AdamWConfig,
    warnings: &mut Vec<String>,
) -> Result<(), EngineError> {
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
        optim.weight_decay = 0.0;
    }
    if let Some(p) = o.get("params") {
        let p = as_object("optimizer.params", p)?;
        for (pk, pv) in p {
            match pk.as_str() {
                "lr" => {
                    if let Some(v) = opt_f32(p, pk, warnings)? {
                        optim.lr = v;
                    }
                }
                "eps" => {
                    if let Some(v) = opt_f32(p, pk, warnings)? {
                        optim.eps = v;
                    }
                }
                "weight_decay" => {
                    if let Some(v) = opt_f32(p, pk, warnings)? {
                        optim.weight_decay = v;
                    }
                }
                "betas" => {
                    let arr = pv.as_array().filter(|a| a.len() == 2);
                    let betas: Option<Vec<f32>> =
                        arr.map(|a| a.iter().filter_map(|x| x.as_f64().map(|x| x as f32)).collect());
                    match betas.as_deref() {
                        Some([b1, b2]) => {
                            optim.beta1 = *b1;
                            optim.beta2 = *b2;
                        }
                        _ => {
                            return Err(type_err("optimizer.params.betas", "[beta1, beta2]", pv));
                        }
                    }
                }
                other => {
                    warnings.push(format!("`optimizer.params.{other}` is not supported and was ignored"))
                }
            }
        }
    }
    Ok(())
}

/// The ZeRO++ switches of `zero_optimization`, applied after the whole file
/// is read (whatever the key order).
#[derive(Debug, Default)]
pub(super) struct ZeroSwitches {
    /// `zero_quantized_weights`.
    pub(super) qwz: Option<bool>,
    /// `zero_quantized_gradients`.
    pub(super) qgz: Option<bool>,
    /// `zeropp_loco_param`.
    pub(super) loco: Option<LocoConfig>,
}

/// Applies `zero_optimization` (`z`) to `zero`; returns the switches.
pub(super) fn zero_optimization(
    z: &Map<String, Value>,
    zero: &mut ZeroConfig,
    warnings: &mut Vec<String>,
) -> Result<ZeroSwitches, EngineError> {
    let mut switches = ZeroSwitches::default();
    for (zk, zv) in z {
        match zk.as_str() {
            "stage" => match zv.as_u64() {
                Some(3) => zero.stage = 3,
                Some(s) => {
                    return Err(EngineError::InvalidConfig(format!(
                        "DeepSpeed config: zero_optimization.stage {s} is not supported (only stage 3)"
                    )));
                }
                None => return Err(type_err("zero_optimization.stage", "an integer", zv)),
            },
            "zero_quantized_weights" => {
                switches.qwz = opt_bool(z, zk)?;
            }
            "zero_quantized_gradients" => {
                switches.qgz = opt_bool(z, zk)?;
            }
            "zeropp_loco_param" => {
                let lp = as_object("zero_optimization.zeropp_loco_param", zv)?;
                let mut loco = LocoConfig::default();
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
                switches.loco = Some(loco);
            }
            "zero_hpz_partition_size" => {
                if let Some(n) = opt_usize(z, zk, warnings)? {
                    zero.hpz_size = n;
                }
            }
            "reduce_bucket_size" => {
                if let Some(n) = opt_elements(z, zk, warnings)? {
                    if n == 0 {
                        return Err(type_err(
                            "zero_optimization.reduce_bucket_size",
                            "a positive integer (elements)",
                            zv,
                        ));
                    }
                    zero.buckets.reduce_bucket_size = Some(n);
                }
            }
            "stage3_prefetch_bucket_size" => {
                if let Some(n) = opt_elements(z, zk, warnings)? {
                    zero.buckets.prefetch_bucket_size = Some(n);
                }
            }
            "stage3_param_persistence_threshold" => {
                if let Some(n) = opt_elements(z, zk, warnings)? {
                    zero.buckets.param_persistence_threshold = n;
                }
            }
            "stage3_max_live_parameters" => {
                if let Some(n) = opt_elements(z, zk, warnings)? {
                    zero.buckets.max_live_parameters = Some(n);
                }
            }
            k if IGNORED_ZERO.contains(&k) => {
                warnings.push(format!("`zero_optimization.{k}` is not modelled by zeropp and was ignored"));
            }
            k => warnings.push(format!("unknown key `zero_optimization.{k}` was ignored")),
        }
    }
    Ok(switches)
}
