//! Running one stage: forward on plain tensors, backward by recomputing it on
//! `Var`s, on the rank's matmul pool; the loss.

use std::cell::RefCell;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarBuilder;
use zeropp_engine::EngineError;
use zeropp_engine::model::kit::split_params_mut;

use super::{CandleModel, CandleTape, Kept, StageDef};
use crate::error::{CandleError, Result};
use crate::params::gathered;

thread_local! {
    /// This thread's pool for candle's matmuls, and its size.
    static POOL: RefCell<Option<(usize, Arc<rayon::ThreadPool>)>> = const { RefCell::new(None) };
}

/// Runs `f` on this thread's pool of `threads` threads (candle's gemm splits
/// its work over the current rayon pool); with 0 threads, on this thread.
pub(super) fn on_pool<T: Send>(
    threads: usize,
    f: impl FnOnce() -> T + Send,
) -> std::result::Result<T, EngineError> {
    if threads == 0 {
        return Ok(f());
    }
    let pool = POOL.with(|p| -> std::result::Result<Arc<rayon::ThreadPool>, EngineError> {
        let mut p = p.borrow_mut();
        if let Some((n, pool)) = p.as_ref()
            && *n == threads
        {
            return Ok(Arc::clone(pool));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| EngineError::Training(format!("cannot start candle's matmul threads: {e}")))?;
        let pool = Arc::new(pool);
        *p = Some((threads, Arc::clone(&pool)));
        Ok(pool)
    })?;
    Ok(pool.install(f))
}

/// One core's L2 cache in bytes (Linux sysfs, `cpu0`), else 2 MiB.
fn l2_cache_bytes() -> usize {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).ok().map(|s| s.trim().to_string());
    (0..8)
        .map(|i| dir.join(format!("index{i}")))
        .find(|d| read(d.join("level")).as_deref() == Some("2"))
        .and_then(|d| read(d.join("size")))
        .and_then(|s| {
            let (num, mult) = match s.strip_suffix('K') {
                Some(n) => (n, 1 << 10),
                None => match s.strip_suffix('M') {
                    Some(n) => (n, 1 << 20),
                    None => (s.as_str(), 1),
                },
            };
            num.parse::<usize>().ok().map(|n| n * mult)
        })
        .unwrap_or(2 << 20)
}

/// The mean softmax cross-entropy of `logits` (`[b, t, v]`) against `targets` (`[b·t]`).
pub(super) fn loss_of(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    candle_nn::loss::cross_entropy(&logits.reshape((b * t, v))?, targets)
}

impl CandleModel {
    pub(super) fn stage(&self, layer: usize) -> std::result::Result<&StageDef, EngineError> {
        self.stages.get(layer).ok_or(EngineError::LayerOutOfRange { layer, layers: self.stages.len() })
    }

    pub(super) fn forward_stage(&self, layer: usize, params: &[f32], tape: &mut CandleTape) -> Result<()> {
        let stage = self.stage(layer)?;
        let last = layer + 1 == self.stages.len();
        let input = if layer == 0 {
            tape.ids.clone()
        } else {
            tape.act
                .take()
                .ok_or_else(|| CandleError::Config("forward without the previous stage's output".into()))?
        };
        let out = if self.keep_graph {
            let (g, vars) = gathered(&stage.name, &stage.params, params, true)?;
            let input_var = if layer == 0 { None } else { Some(Var::from_tensor(&input)?) };
            let x = input_var.as_ref().map_or(&input, |v| v.as_tensor());
            let out = (stage.run)(VarBuilder::from_backend(Box::new(g), DType::F32, Device::Cpu), x)?;
            if let Some(k) = tape.kept.get_mut(layer) {
                *k = Some(Kept { out: out.clone(), vars, input: input_var });
            }
            out
        } else {
            let (g, _) = gathered(&stage.name, &stage.params, params, false)?;
            let out = (stage.run)(VarBuilder::from_backend(Box::new(g), DType::F32, Device::Cpu), &input)?;
            if layer > 0
                && let Some(slot) = tape.inputs.get_mut(layer)
            {
                *slot = Some(input);
            }
            out
        };
        if last {
            tape.loss = loss_of(&out, &tape.targets)?.to_scalar::<f32>()?;
        } else {
            tape.act = Some(out.detach());
        }
        Ok(())
    }

    pub(super) fn backward_stage(
        &self,
        layer: usize,
        params: &[f32],
        tape: &mut CandleTape,
        grad: &mut [f32],
    ) -> Result<()> {
        let stage = self.stage(layer)?;
        let last = layer + 1 == self.stages.len();
        let (out, vars, input) = match tape.kept.get_mut(layer).and_then(Option::take) {
            Some(k) => (k.out, k.vars, k.input),
            None => {
                let (g, vars) = gathered(&stage.name, &stage.params, params, true)?;
                let input = if layer == 0 {
                    None
                } else {
                    let x = tape.inputs.get_mut(layer).and_then(Option::take).ok_or_else(|| {
                        CandleError::Config(format!("stage {:?}: backward without its forward", stage.name))
                    })?;
                    Some(Var::from_tensor(&x)?)
                };
                let x = input.as_ref().map_or(&tape.ids, |v| v.as_tensor());
                let out = (stage.run)(VarBuilder::from_backend(Box::new(g), DType::F32, Device::Cpu), x)?;
                (out, vars, input)
            }
        };
        let objective = if last {
            loss_of(&out, &tape.targets)?
        } else {
            let up = tape.upstream.take().ok_or_else(|| {
                CandleError::Config(format!(
                    "stage {:?}: backward without the gradient from above",
                    stage.name
                ))
            })?;
            if up.dims() != out.dims() {
                return Err(CandleError::Config(format!(
                    "stage {:?}: output {:?}, upstream gradient {:?}",
                    stage.name,
                    out.dims(),
                    up.dims()
                )));
            }
            (&out * &up)?.sum_all()?
        };
        let grads = objective.backward()?;
        let mut parts = split_params_mut(&self.layers[layer], grad)?;
        for ((var, info), dst) in vars.iter().zip(&stage.params).zip(parts.iter_mut()) {
            let g = grads.get(var.as_tensor()).ok_or_else(|| CandleError::MissingGradient {
                stage: stage.name.clone(),
                param: info.name.clone(),
            })?;
            let v = g.flatten_all()?.to_vec1::<f32>()?;
            dst.copy_from_slice(&v);
        }
        if let Some(input) = input {
            let g = grads
                .get(input.as_tensor())
                .ok_or_else(|| CandleError::MissingInputGradient { stage: stage.name.clone() })?;
            tape.upstream = Some(g.detach());
        }
        Ok(())
    }

    /// The activation bytes of the stage inputs the tape keeps (every stage but
    /// the first) and of the logits with their softmax, for `(batch, seq)`.
    pub(super) fn boundary_bytes(&self, batch: usize, seq: usize) -> usize {
        let tokens = batch * seq;
        let inputs: usize = self.stages.iter().rev().skip(1).map(|s| s.width).sum();
        4 * tokens * (inputs + 3 * self.vocab)
    }

    /// The memory candle's CPU matmuls hold on each of a rank's matmul
    /// threads: the `gemm` crate keeps one packing slab the size of a core's L2
    /// cache per thread that has run a matmul (read from Linux's sysfs; 2 MiB
    /// where it cannot be read). With candle's own threading (0), one slab.
    pub fn matmul_workspace_bytes(&self) -> usize {
        self.threads.max(1) * l2_cache_bytes()
    }
}
