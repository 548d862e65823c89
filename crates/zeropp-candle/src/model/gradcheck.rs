//! The build-time gradient check: every element of every weight must be
//! reachable by the backward pass. A weight partly behind an op with no
//! backward (candle-nn's fused kernels) would otherwise train those elements
//! on a silent zero.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarBuilder;
use zeropp_engine::model::kit::split_params_mut;
use zeropp_quant::rng::stream_seed;

use super::{CandleModel, StageContext, stage_key};
use crate::error::{CandleError, Result};
use crate::params::{gathered, init_param, uniform};

/// The seed of the check's weights, inputs and upstream gradients.
const PROBE_SEED: u64 = 0x6E_AD_C4_EC;

/// Rows of a later stage's trial input (the first stage sees every token id).
const LATER_ROWS: usize = 2;

/// `n` values uniform in `[-scale, scale)` from stream `key`.
fn noise(key: u64, n: usize, scale: f64) -> impl Iterator<Item = f32> {
    (0..n as u64).map(move |i| ((2.0 * uniform(key, i) - 1.0) * scale) as f32)
}

/// The zero elements of a parameter of shape `shape`, as ranges (rows where
/// a range covers whole rows).
fn describe(zeros: &[usize], shape: &[usize]) -> String {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &i in zeros {
        match runs.last_mut() {
            Some((_, end)) if *end == i => *end += 1,
            _ => runs.push((i, i + 1)),
        }
    }
    let row = if shape.len() >= 2 { shape[1..].iter().product::<usize>() } else { 0 };
    let mut parts: Vec<String> = runs
        .iter()
        .take(4)
        .map(|&(a, b)| {
            if row > 0 && a % row == 0 && b % row == 0 {
                format!("rows {}..{}", a / row, b / row)
            } else {
                format!("elements {a}..{b}")
            }
        })
        .collect();
    if runs.len() > 4 {
        parts.push(format!("{} more ranges", runs.len() - 4));
    }
    let total: usize = shape.iter().product();
    format!("{} of {total} elements ({})", zeros.len(), parts.join(", "))
}

impl CandleModel {
    /// Runs every stage once forward and backward, on weights perturbed from
    /// their init (so no element is zero by construction, such as a LoRA
    /// factor initialised to zero), a first batch that uses every token id and
    /// a random upstream gradient; fails on a weight with no gradient, a
    /// stage input with none, or a weight element whose gradient is exactly
    /// zero (unless its name is in `allowed`).
    pub(super) fn check_gradient_paths(&self, allowed: &[String]) -> Result<()> {
        let rows = self.vocab.div_ceil(self.seq_len).max(1);
        let ids: Vec<u32> = (0..rows * self.seq_len).map(|i| (i % self.vocab) as u32).collect();
        let mut params = Vec::with_capacity(self.stages.len());
        for (l, layer) in self.layers.iter().enumerate() {
            let mut flat = vec![0.0f32; layer.numel()];
            for (i, (p, dst)) in
                self.stages[l].params.iter().zip(split_params_mut(layer, &mut flat)?).enumerate()
            {
                init_param(&p.init, &p.shape, PROBE_SEED, l, i, dst);
                let key = stream_seed(PROBE_SEED, &[1, l as u64, i as u64]);
                for (d, n) in dst.iter_mut().zip(noise(key, p.numel(), 0.05)) {
                    *d += n;
                }
            }
            params.push(flat);
        }
        let mut x = Tensor::from_vec(ids, (rows, self.seq_len), &Device::Cpu)?;
        // Each stage's trial input, output and upstream gradient, for the
        // influence and direction tests below.
        let mut trial: Vec<(Tensor, Tensor, Tensor)> = Vec::with_capacity(self.stages.len());
        // Per stage and parameter, the gradient (a tied owner's includes its other uses).
        let mut grads: Vec<Vec<Vec<f32>>> = Vec::with_capacity(self.stages.len());
        let mut lent: HashMap<(usize, usize), Vec<f32>> = HashMap::new();
        for (l, stage) in self.stages.iter().enumerate() {
            let (mut g, vars) = gathered(&stage.name, &stage.params, &params[l], true)?;
            let mut borrowed = Vec::new();
            self.add_ties(stage, &mut g, |b| {
                let v = Var::from_tensor(&self.lent_slice(&params, b)?)?;
                let t = v.as_tensor().clone();
                borrowed.push(v);
                Ok(t)
            })?;
            let input = if l == 0 { None } else { Some(Var::from_tensor(&x)?) };
            // Evaluation mode: dropout's zeros are not missing gradients (a
            // weight cut off only in training still fails the per-step check).
            let ctx = StageContext::new(false, stage_key(PROBE_SEED, l));
            let vb = VarBuilder::from_backend(Box::new(g), DType::F32, Device::Cpu);
            let out = (stage.run)(vb, input.as_ref().map_or(&x, |v| v.as_tensor()), &ctx).map_err(|e| {
                CandleError::Config(format!(
                    "stage {:?} failed in the gradient check (a batch of {} sequences): {e}",
                    stage.name,
                    x.dim(0).unwrap_or(0)
                ))
            })?;
            let key = stream_seed(PROBE_SEED, &[2, l as u64]);
            let up =
                Tensor::from_iter(noise(key, out.elem_count(), 1.0), &Device::Cpu)?.reshape(out.shape())?;
            let store = (out.to_dtype(DType::F32)? * &up)?.sum_all()?.backward()?;
            let missing =
                |param: &str| CandleError::MissingGradient { stage: stage.name.clone(), param: param.into() };
            let mut own = Vec::with_capacity(vars.len());
            for (v, info) in vars.iter().zip(&stage.params) {
                let gv = store.get(v.as_tensor()).ok_or_else(|| missing(&info.name))?;
                own.push(gv.flatten_all()?.to_vec1::<f32>()?);
            }
            for (b, v) in stage.borrows.iter().zip(&borrowed) {
                let gv = store.get(v.as_tensor()).ok_or_else(|| missing(&b.local))?;
                let gv = gv.flatten_all()?.to_vec1::<f32>()?;
                match lent.get_mut(&(b.owner, b.param)) {
                    Some(acc) => acc.iter_mut().zip(&gv).for_each(|(a, g)| *a += g),
                    None => {
                        lent.insert((b.owner, b.param), gv);
                    }
                }
            }
            if let Some(input) = &input
                && store.get(input.as_tensor()).is_none()
            {
                return Err(CandleError::MissingInputGradient { stage: stage.name.clone() });
            }
            grads.push(own);
            trial.push((x.clone(), out.detach(), up));
            x = out.detach();
            if x.dim(0)? > LATER_ROWS {
                x = x.narrow(0, 0, LATER_ROWS)?;
            }
        }
        for (l, stage) in self.stages.iter().enumerate() {
            for (i, info) in stage.params.iter().enumerate() {
                let full = format!("{}.{}", stage.name, info.name);
                if allowed.contains(&full) {
                    continue;
                }
                let extra = lent.get(&(l, i));
                let zeros: Vec<usize> = grads[l][i]
                    .iter()
                    .enumerate()
                    .filter(|&(j, &g)| g + extra.map_or(0.0, |e| e[j]) == 0.0)
                    .map(|(j, _)| j)
                    .collect();
                if !zeros.is_empty() && self.influences(&params, &trial, (l, i), &zeros)? {
                    return Err(CandleError::PartialGradient {
                        stage: stage.name.clone(),
                        param: info.name.clone(),
                        shape: info.shape.clone(),
                        zeros: describe(&zeros, &info.shape),
                    });
                }
                let total: Vec<f32> = match extra {
                    Some(e) => grads[l][i].iter().zip(e).map(|(g, e)| g + e).collect(),
                    None => grads[l][i].clone(),
                };
                if let Some((backward, differences)) = self.disagrees(&params, &trial, (l, i), &total)? {
                    return Err(CandleError::WrongGradient {
                        stage: stage.name.clone(),
                        param: info.name.clone(),
                        backward,
                        differences,
                    });
                }
            }
        }
        Ok(())
    }

    /// Whether moving elements `zeros` of parameter `(stage, param)` changes
    /// the output of a stage that uses it (its own, or a stage it is tied
    /// into): a zero gradient of an element that matters is a cut path; one
    /// of an element that does not (a key bias, whose shift the attention's
    /// softmax cancels) is the true gradient.
    fn influences(
        &self,
        params: &[Vec<f32>],
        trial: &[(Tensor, Tensor, Tensor)],
        (owner, param): (usize, usize),
        zeros: &[usize],
    ) -> Result<bool> {
        let stage = &self.stages[owner];
        let at: usize = stage.params.iter().take(param).map(|p| p.numel()).sum();
        let n = stage.params[param].numel();
        let mut moved = params.to_vec();
        let slice = &mut moved[owner][at..at + n];
        let rms = (slice.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / n.max(1) as f64).sqrt();
        let step = 0.1 * rms.max(0.1);
        let key = stream_seed(PROBE_SEED, &[3, owner as u64, param as u64]);
        for (&j, u) in zeros.iter().zip(noise(key, zeros.len(), 1.0)) {
            slice[j] += (step * f64::from(u.signum())) as f32;
        }
        for u in self.users(owner, param) {
            let (_, base, _) = &trial[u];
            let out = self.rerun(&moved, trial, u)?;
            let base = base.to_dtype(DType::F32)?;
            let scale = base.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-6);
            let change = (out - base)?.abs()?.max_all()?.to_scalar::<f32>()?;
            // Rounding moves an output by ~1e-7 of its scale; a real use by far more.
            if change > 1e-4 * scale {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The stages that use parameter `(owner, param)`: its own, and those it
    /// is tied into.
    fn users(&self, owner: usize, param: usize) -> Vec<usize> {
        std::iter::once(owner)
            .chain(
                self.stages
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.borrows.iter().any(|b| (b.owner, b.param) == (owner, param)))
                    .map(|(u, _)| u),
            )
            .collect()
    }

    /// Stage `u`'s output on its trial input with weights `params` (no graph).
    fn rerun(&self, params: &[Vec<f32>], trial: &[(Tensor, Tensor, Tensor)], u: usize) -> Result<Tensor> {
        let s = &self.stages[u];
        let (mut g, _) = gathered(&s.name, &s.params, &params[u], false)?;
        self.add_ties(s, &mut g, |b| self.lent_slice(params, b))?;
        let ctx = StageContext::new(false, stage_key(PROBE_SEED, u));
        let vb = VarBuilder::from_backend(Box::new(g), DType::F32, Device::Cpu);
        Ok((s.run)(vb, &trial[u].0, &ctx)?.to_dtype(DType::F32)?)
    }

    /// The directional test: with `F = Σ_users ⟨out, upstream⟩` and a random
    /// ±1 direction `u`, compares the backward's `g · u` with central
    /// differences of `F` along `u` (in f64 sums over f32 outputs). A path
    /// cut while another still reaches every element shows as a mismatch;
    /// `Some((g · u, differences))` when they disagree by more than 5% of the
    /// larger, beyond the differences' rounding noise.
    fn disagrees(
        &self,
        params: &[Vec<f32>],
        trial: &[(Tensor, Tensor, Tensor)],
        (owner, param): (usize, usize),
        grad: &[f32],
    ) -> Result<Option<(f64, f64)>> {
        let stage = &self.stages[owner];
        let at: usize = stage.params.iter().take(param).map(|p| p.numel()).sum();
        let n = stage.params[param].numel();
        let w = &params[owner][at..at + n];
        let rms = (w.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / n.max(1) as f64).sqrt();
        // Small enough that few ReLU-like kinks are crossed, large enough for f32.
        let eps = 1e-3 * rms.max(0.01);
        let key = stream_seed(PROBE_SEED, &[4, owner as u64, param as u64]);
        let dir: Vec<f64> = noise(key, n, 1.0).map(|u| f64::from(u.signum())).collect();
        let backward: f64 = grad.iter().zip(&dir).map(|(&g, &u)| f64::from(g) * u).sum();
        let users = self.users(owner, param);
        // F at w + s·eps·u, and Σ|out ⊙ up| (the scale of F's rounding).
        let objective = |s: f64| -> Result<(f64, f64)> {
            let mut moved = params.to_vec();
            for (v, &u) in moved[owner][at..at + n].iter_mut().zip(&dir) {
                *v = (f64::from(*v) + s * eps * u) as f32;
            }
            let (mut f, mut size) = (0.0, 0.0);
            for &u in &users {
                let out = self.rerun(&moved, trial, u)?.to_dtype(DType::F64)?;
                let prod = (out * trial[u].2.to_dtype(DType::F64)?)?;
                f += prod.sum_all()?.to_scalar::<f64>()?;
                size += prod.abs()?.sum_all()?.to_scalar::<f64>()?;
            }
            Ok((f, size))
        };
        let ((plus, size), (minus, _)) = (objective(1.0)?, objective(-1.0)?);
        let differences = (plus - minus) / (2.0 * eps);
        // f32 outputs carry ~1e-7 relative rounding each; kept well clear of it.
        let noise = 1e-5 * size / eps;
        let gap = (differences - backward).abs();
        Ok((gap > 0.05 * differences.abs().max(backward.abs()) + noise).then_some((backward, differences)))
    }
}
