//! How a stage gets its weights: two candle-nn `SimpleBackend`s behind the
//! `VarBuilder` a stage is written against.
//!
//! - [`Recorder`] runs once, when the model is built: it records every tensor
//!   the stage asks for (name, shape, candle-nn's init hint) and hands back
//!   zeros. The records become the stage's [`TensorSpec`]s, in the order asked.
//! - [`Gathered`] serves the weights the engine gathered for a forward or a
//!   backward: the layer's flat buffer cut into named tensors (candle `Var`s in
//!   a backward, so candle's autograd sees them).
//!
//! [`init_param`] turns an init hint into values deterministically from
//! `(seed, layer, param)`, so every rank and every process initialises a stage
//! alike (candle's own random init on the CPU cannot be seeded).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::init::{FanInOut, NonLinearity, NormalOrUniform};
use candle_nn::{Init, var_builder::SimpleBackend};
use zeropp_engine::model::TensorSpec;
use zeropp_quant::rng::{splitmix64, stream_seed};

use crate::error::{CandleError, Result};

/// One parameter a stage asked for.
#[derive(Debug, Clone)]
pub(crate) struct ParamInfo {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) init: Init,
}

impl ParamInfo {
    pub(crate) fn spec(&self) -> TensorSpec {
        TensorSpec::new(self.name.clone(), self.shape.clone())
    }

    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Records the tensors a stage asks for; hands back zeros.
#[derive(Debug, Clone, Default)]
pub(crate) struct Recorder {
    params: Arc<Mutex<Vec<ParamInfo>>>,
    /// Names asked for more than once (same shape).
    repeats: Arc<Mutex<Vec<String>>>,
}

impl Recorder {
    pub(crate) fn params(&self) -> Vec<ParamInfo> {
        self.params.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The names asked for more than once, each once, in the order first repeated.
    pub(crate) fn repeats(&self) -> Vec<String> {
        self.repeats.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

impl SimpleBackend for Recorder {
    fn get(
        &self,
        s: Shape,
        name: &str,
        init: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut params = self.params.lock().unwrap_or_else(PoisonError::into_inner);
        match params.iter().find(|p| p.name == name) {
            Some(p) if p.shape != s.dims() => {
                return Err(candle_core::Error::Msg(format!(
                    "parameter {name:?} asked for with shape {:?} and with shape {:?}",
                    p.shape,
                    s.dims()
                )));
            }
            Some(_) => {
                let mut repeats = self.repeats.lock().unwrap_or_else(PoisonError::into_inner);
                if !repeats.iter().any(|r| r == name) {
                    repeats.push(name.to_string());
                }
            }
            None => params.push(ParamInfo { name: name.to_string(), shape: s.dims().to_vec(), init }),
        }
        Tensor::zeros(s, dtype, dev)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        Err(candle_core::Error::Msg(format!(
            "parameter {name:?} asked for without a shape: a stage must ask with `vb.get(shape, name)` so its \
             layout is known before training"
        )))
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.params.lock().unwrap_or_else(PoisonError::into_inner).iter().any(|p| p.name == name)
    }
}

/// The gathered weights of one stage, by name.
#[derive(Debug)]
pub(crate) struct Gathered {
    pub(crate) stage: String,
    pub(crate) tensors: HashMap<String, Tensor>,
}

impl SimpleBackend for Gathered {
    fn get(&self, s: Shape, name: &str, _: Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = self.tensors.get(name).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "stage {:?} asked for parameter {name:?}, which it did not ask for when the model was built",
                self.stage
            ))
        })?;
        if t.dims() != s.dims() {
            return Err(candle_core::Error::Msg(format!(
                "stage {:?} asked for parameter {name:?} with shape {:?}, built with {:?}",
                self.stage,
                s.dims(),
                t.dims()
            )));
        }
        // Same dtype and device: these return the tensor itself, so a Var's
        // gradient is found under it.
        t.to_device(dev)?.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = self.tensors.get(name).ok_or_else(|| {
            candle_core::Error::Msg(format!("stage {:?} has no parameter {name:?}", self.stage))
        })?;
        t.to_device(dev)?.to_dtype(dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

/// A uniform draw in `[0, 1)` from a counter-based stream.
pub(crate) fn uniform(key: u64, i: u64) -> f64 {
    (splitmix64(stream_seed(key, &[i])) >> 11) as f64 / (1u64 << 53) as f64
}

/// A standard normal draw (Box-Muller on two uniforms of the stream).
fn normal(key: u64, i: u64) -> f64 {
    let u1 = uniform(key, 2 * i).max(f64::MIN_POSITIVE);
    let u2 = uniform(key, 2 * i + 1);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Fills `out` as candle-nn's `init` hint asks, with values drawn from a stream
/// keyed by `(seed, layer, param)`: the same on every rank and process.
pub(crate) fn init_param(
    init: &Init,
    shape: &[usize],
    seed: u64,
    layer: usize,
    param: usize,
    out: &mut [f32],
) {
    let key = stream_seed(seed, &[0xCA4D1E, layer as u64, param as u64]);
    let fill_uniform = |out: &mut [f32], lo: f64, up: f64| {
        for (i, v) in out.iter_mut().enumerate() {
            *v = (lo + (up - lo) * uniform(key, i as u64)) as f32;
        }
    };
    let fill_normal = |out: &mut [f32], mean: f64, std: f64| {
        for (i, v) in out.iter_mut().enumerate() {
            *v = (mean + std * normal(key, i as u64)) as f32;
        }
    };
    match *init {
        Init::Const(c) => out.fill(c as f32),
        Init::Randn { mean, stdev } => fill_normal(out, mean, stdev),
        Init::Uniform { lo, up } => fill_uniform(out, lo, up),
        Init::Kaiming { dist, fan, non_linearity } => {
            let fan = fan_of(fan, shape);
            let std = gain(non_linearity) / (fan.max(1) as f64).sqrt();
            match dist {
                NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    fill_uniform(out, -bound, bound)
                }
                NormalOrUniform::Normal => fill_normal(out, 0.0, std),
            }
        }
    }
}

/// candle-nn's fan of a shape (`FanInOut::for_shape`).
fn fan_of(fan: FanInOut, shape: &[usize]) -> usize {
    fan.for_shape(&Shape::from(shape.to_vec()))
}

/// candle-nn's gain of a non-linearity.
fn gain(n: NonLinearity) -> f64 {
    n.gain()
}

/// The stage's flat buffer cut into named tensors: plain tensors for a forward
/// (no graph is kept), `Var`s for a backward (returned too, to read their
/// gradients).
pub(crate) fn gathered(
    stage: &str,
    params: &[ParamInfo],
    flat: &[f32],
    track: bool,
) -> Result<(Gathered, Vec<candle_core::Var>)> {
    let total: usize = params.iter().map(ParamInfo::numel).sum();
    if flat.len() != total {
        return Err(CandleError::Config(format!(
            "stage {stage:?}: {} gathered values for {total} parameter elements",
            flat.len()
        )));
    }
    let mut tensors = HashMap::with_capacity(params.len());
    let mut vars = Vec::new();
    let mut at = 0;
    for p in params {
        let slice = &flat[at..at + p.numel()];
        at += p.numel();
        let t = if track {
            let v = candle_core::Var::from_slice(slice, p.shape.as_slice(), &Device::Cpu)?;
            let t = v.as_tensor().clone();
            vars.push(v);
            t
        } else {
            Tensor::from_slice(slice, p.shape.as_slice(), &Device::Cpu)?
        };
        tensors.insert(p.name.clone(), t);
    }
    Ok((Gathered { stage: stage.to_string(), tensors }, vars))
}
