//! Running one stage: forward on plain tensors, backward by recomputing it on
//! `Var`s, on the rank's matmul pool; the loss.

use std::cell::RefCell;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarBuilder;
use zeropp_engine::EngineError;
use zeropp_engine::model::kit::split_params_mut;

use super::{Borrow, CandleModel, CandleTape, Kept, StageContext, StageDef, stage_key};
use crate::error::{CandleError, Result};
use crate::params::{Gathered, gathered};

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

    /// Adds the stage's tied names to `g`: its aliases (its own tensors under
    /// a second name) and its borrows (`lookup` gives the owner's tensor).
    pub(super) fn add_ties(
        &self,
        stage: &StageDef,
        g: &mut Gathered,
        mut lookup: impl FnMut(&Borrow) -> Result<Tensor>,
    ) -> Result<()> {
        for (alias, i) in &stage.aliases {
            let own =
                stage.params.get(*i).and_then(|p| g.tensors.get(&p.name)).cloned().ok_or_else(|| {
                    CandleError::Config(format!(
                        "stage {:?}: alias {alias:?} of a missing parameter",
                        stage.name
                    ))
                })?;
            g.tensors.insert(alias.clone(), own);
        }
        for b in &stage.borrows {
            let t = lookup(b)?;
            g.tensors.insert(b.local.clone(), t);
        }
        Ok(())
    }

    /// Parameter `b.param` of stage `b.owner`, cut from `params` (one flat
    /// vector per stage), as a plain tensor.
    pub(super) fn lent_slice(&self, params: &[Vec<f32>], b: &Borrow) -> Result<Tensor> {
        let owner = self.stage(b.owner)?;
        let at: usize = owner.params.iter().take(b.param).map(|p| p.numel()).sum();
        let info =
            owner.params.get(b.param).ok_or_else(|| CandleError::Config("tie: no such parameter".into()))?;
        let flat = params.get(b.owner).and_then(|p| p.get(at..at + info.numel())).ok_or_else(|| {
            CandleError::Config(format!("tie {:?}: the owner's parameters are too short", b.local))
        })?;
        Ok(Tensor::from_slice(flat, info.shape.as_slice(), &Device::Cpu)?)
    }

    /// The tape's copy of a lent parameter (the owner's forward stored it).
    fn lent_of(tape: &CandleTape, stage: &StageDef, b: &Borrow) -> Result<Tensor> {
        tape.lent.get(&(b.owner, b.param)).cloned().ok_or_else(|| {
            CandleError::Config(format!(
                "stage {:?}: tied parameter {:?} before its owner's forward",
                stage.name, b.local
            ))
        })
    }

    /// Bytes of the tied parameters a tape holds at most: each lent value
    /// and its gradient.
    pub(super) fn lent_bytes(&self) -> usize {
        let floats: usize = self
            .stages
            .iter()
            .flat_map(|s| s.lends.iter().filter_map(|&i| s.params.get(i)))
            .map(|p| p.numel())
            .sum();
        8 * floats
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
        let ctx = StageContext::new(tape.train, stage_key(tape.key, layer));
        // The kept stages (a suffix, the last always: its backward comes right
        // after its forward, so keeping its graph holds its weights no longer).
        let keep = tape.train && self.kept_stages().contains(&layer);
        let (mut g, vars) = gathered(&stage.name, &stage.params, params, keep)?;
        for &i in &stage.lends {
            if let Some(t) = stage.params.get(i).and_then(|p| g.tensors.get(&p.name)) {
                // A copy: the tape must not hold the gathered buffer's Var.
                tape.lent.insert((layer, i), t.detach().copy()?);
            }
        }
        let mut borrowed = Vec::new();
        self.add_ties(stage, &mut g, |b| {
            let t = Self::lent_of(tape, stage, b)?;
            if !keep {
                return Ok(t);
            }
            let v = Var::from_tensor(&t)?;
            let t = v.as_tensor().clone();
            borrowed.push(v);
            Ok(t)
        })?;
        let vb = VarBuilder::from_backend(Box::new(g), DType::F32, Device::Cpu);
        let out = if keep {
            let input_var = if layer == 0 { None } else { Some(Var::from_tensor(&input)?) };
            let x = input_var.as_ref().map_or(&input, |v| v.as_tensor());
            let out = (stage.run)(vb, x, &ctx)?;
            if last {
                // The loss, once: the backward differentiates this tensor.
                let loss = loss_of(&out, &tape.targets)?;
                tape.loss = loss.to_scalar::<f32>()?;
                if let Some(k) = tape.kept.get_mut(layer) {
                    *k = Some(Kept { out: loss, vars, input: input_var, borrowed });
                }
                return Ok(());
            }
            if let Some(k) = tape.kept.get_mut(layer) {
                *k = Some(Kept { out: out.clone(), vars, input: input_var, borrowed });
            }
            out
        } else {
            let out = (stage.run)(vb, &input, &ctx)?;
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
        // `Some(loss)` where the last stage's forward kept it.
        let mut kept_loss = None;
        let (out, vars, input, borrowed) = match tape.kept.get_mut(layer).and_then(Option::take) {
            Some(k) if last => {
                kept_loss = Some(k.out.clone());
                (k.out, k.vars, k.input, k.borrowed)
            }
            Some(k) => (k.out, k.vars, k.input, k.borrowed),
            None => {
                let (mut g, vars) = gathered(&stage.name, &stage.params, params, true)?;
                let mut borrowed = Vec::new();
                self.add_ties(stage, &mut g, |b| {
                    let v = Var::from_tensor(&Self::lent_of(tape, stage, b)?)?;
                    let t = v.as_tensor().clone();
                    borrowed.push(v);
                    Ok(t)
                })?;
                let input = if layer == 0 {
                    None
                } else {
                    let x = tape.inputs.get_mut(layer).and_then(Option::take).ok_or_else(|| {
                        CandleError::Config(format!("stage {:?}: backward without its forward", stage.name))
                    })?;
                    Some(Var::from_tensor(&x)?)
                };
                let x = input.as_ref().map_or(&tape.ids, |v| v.as_tensor());
                // The forward's context again: dropout replays its masks.
                let ctx = StageContext::new(tape.train, stage_key(tape.key, layer));
                let out =
                    (stage.run)(VarBuilder::from_backend(Box::new(g), DType::F32, Device::Cpu), x, &ctx)?;
                (out, vars, input, borrowed)
            }
        };
        let objective = if let Some(loss) = kept_loss {
            loss
        } else if last {
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
        let missing = |param: &str| CandleError::MissingGradient {
            stage: stage.name.clone(),
            param: param.to_string(),
        };
        for (b, v) in stage.borrows.iter().zip(&borrowed) {
            let g = grads.get(v.as_tensor()).ok_or_else(|| missing(&b.local))?.detach();
            let sum = match tape.lent_grads.remove(&(b.owner, b.param)) {
                Some(prev) => (prev + g)?,
                None => g,
            };
            tape.lent_grads.insert((b.owner, b.param), sum);
        }
        let mut parts = split_params_mut(&self.layers[layer], grad)?;
        for (i, ((var, info), dst)) in vars.iter().zip(&stage.params).zip(parts.iter_mut()).enumerate() {
            let g = grads.get(var.as_tensor()).ok_or_else(|| missing(&info.name))?;
            let v = g.flatten_all()?.to_vec1::<f32>()?;
            dst.copy_from_slice(&v);
            if stage.lends.contains(&i) {
                tape.lent.remove(&(layer, i));
                // The later stages' uses of a tied parameter.
                if let Some(extra) = tape.lent_grads.remove(&(layer, i)) {
                    for (d, e) in dst.iter_mut().zip(extra.flatten_all()?.to_vec1::<f32>()?) {
                        *d += e;
                    }
                }
            }
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
