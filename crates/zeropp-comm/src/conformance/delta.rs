//! qwZ-Δ's encode, exchange and apply
//! ([`qwz_delta_exchange`](crate::collectives::qwz_delta_exchange)) against a sequential reference:
//! every holder's copy equals every owner's reconstruction bit for bit, over a
//! few difference steps, for every hpZ group size that divides the node.

use half::bf16;
use zeropp_quant::encoded_len;

use crate::collectives::DeltaOptions;

use super::common::*;
use super::paths::{Collectives, CopyElem};

/// Three difference steps of weights that move every step, for every hpZ size
/// `H` dividing the node size, with f32 and bf16 copies: after each step, this
/// rank's copy of every shard it holds equals that shard's owner's
/// reconstruction (computed here, sequentially, for every owner), and stays
/// within one INT4 step of the owner's weights.
pub fn check_qwz_delta<X: Collectives + ?Sized>(x: &mut X, case: &Case) -> Result<(), String> {
    let topo = x.topology();
    let (w, rank, l) = (topo.world(), x.rank(), topo.local_size());
    let s = case.len.max(1);
    for hpz in (1..=l).filter(|h| l.is_multiple_of(*h)) {
        run::<f32, X>(x, case, hpz, s, w, rank)?;
        run::<bf16, X>(x, case, hpz, s, w, rank)?;
    }
    Ok(())
}

fn run<T: CopyElem, X: Collectives + ?Sized>(
    x: &mut X,
    case: &Case,
    hpz: usize,
    s: usize,
    w: usize,
    rank: usize,
) -> Result<(), String> {
    let opts = DeltaOptions::default();
    let e = encoded_len(opts.spec, s);
    // Every owner's reconstruction, and this rank's copy of the shards it holds.
    let mut owners: Vec<Vec<T>> = vec![vec![T::default(); s]; w];
    let per = w / hpz;
    let h = x.topology().local_rank(rank) % hpz;
    let mut copy: Vec<T> = vec![T::default(); per * s];
    for step in 0..3u64 {
        let weights = |r: usize| rank_data(case.seed + 900 + step, r, s);
        let mut encodings = vec![vec![0u8; e]; w];
        for (r, (own, enc)) in owners.iter_mut().zip(&mut encodings).enumerate() {
            x.delta_encode(&weights(r), own, &opts, enc).map_err(|e| err("delta_encode", e))?;
        }
        let got = x.qwz_delta_exchange(hpz, &encodings[rank]).map_err(|e| err("qwz_delta_exchange", e))?;
        ensure(got.len() == per * e, || {
            format!("qwz_delta H={hpz}: {} bytes, expected {}", got.len(), per * e)
        })?;
        for (k, enc) in got.chunks(e).enumerate() {
            let owner = h * per + k;
            ensure(enc == encodings[owner].as_slice(), || {
                format!("qwz_delta H={hpz} step {step}: the difference of shard {owner} arrived changed")
            })?;
            let part = &mut copy[k * s..(k + 1) * s];
            x.delta_apply(part, enc, &opts).map_err(|e| err("delta_apply", e))?;
            let same =
                part.iter().zip(&owners[owner]).all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits());
            ensure(same, || {
                format!("qwz_delta H={hpz} step {step}: copy of shard {owner} differs from its owner's")
            })?;
            let target = weights(owner);
            let amax =
                target.iter().zip(part.iter()).map(|(a, b)| (a - b.to_f32()).abs()).fold(0.0f32, f32::max);
            // The difference of step 0 is the weights themselves (|x| < 2); later
            // ones are what the weights moved plus the last step's error.
            ensure(amax <= 4.0 / 8.0 + 0.01, || format!("qwz_delta H={hpz} step {step}: error {amax}"))?;
        }
    }
    Ok(())
}
