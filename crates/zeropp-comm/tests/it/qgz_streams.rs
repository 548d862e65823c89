//! qgZ with stochastic rounding: the ranks' contributions to one element round
//! with independent random draws, so the error variance of an L-way sum grows
//! like L (the mean's like 1/L), not like L² (a mean that does not shrink), and
//! LoCo error feedback works on both hops.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap

use zeropp_comm::collectives::{
    ErrorFeedback, QgzOptions, ResidualPrecision, qgz_reduce_scatter, qgz_reduce_scatter_with_feedback,
};
use zeropp_comm::{ThreadCluster, ThreadOptions, Topology};
use zeropp_quant::half::bf16;
use zeropp_quant::rng::splitmix64;
use zeropp_quant::{Options, QuantSpec};

const N: usize = 1 << 15;
const GROUP: usize = 128;

/// The same gradient on every rank: in each group of 128, element 0 is 1.0 (the
/// group's amax, so INT4's step is 1/8) and the others are spread over
/// (-0.85, 0.85), inside the grid's unclamped range [-1, 7/8], so every one is
/// rounded stochastically and none is clamped (clamping is deterministic, hence
/// correlated across ranks).
fn shared_gradient() -> Vec<f32> {
    (0..N)
        .map(|i| {
            if i % GROUP == 0 {
                1.0
            } else {
                let u = (splitmix64(i as u64) >> 40) as f32 / (1u64 << 24) as f32;
                0.85 * (2.0 * u - 1.0)
            }
        })
        .collect()
}

/// Mean squared error of the qgZ mean against the (exact) shared value, over the
/// non-amax elements of every rank's shard.
fn mean_sq_error(world: usize, local: usize) -> f64 {
    let t = Topology::ranks(world).per_node(local).unwrap();
    let g = shared_gradient();
    let int4 = QuantSpec::int4(GROUP).unwrap();
    let opts = QgzOptions {
        intra_spec: int4,
        inter_spec: int4,
        // The chunk a rank keeps is INT4 too, so all L contributions have the same error law.
        local_spec: int4,
        quant: Options::default().stochastic(42),
        ..QgzOptions::default()
    };
    let shards = ThreadCluster::new(t, ThreadOptions::default())
        .run(|comm| {
            let mut shard = vec![0.0f32; N / world];
            qgz_reduce_scatter(comm, &g, &mut shard, &opts)?;
            Ok::<_, zeropp_comm::CommError>(shard)
        })
        .unwrap();
    let full: Vec<f32> = shards.concat();
    let (mut sum, mut count) = (0.0f64, 0usize);
    for (i, (&y, &x)) in full.iter().zip(&g).enumerate() {
        if i % GROUP != 0 {
            sum += (f64::from(y) - f64::from(x)).powi(2);
            count += 1;
        }
    }
    sum / count as f64
}

/// `V(8) / V(2)` (see [`mean_sq_error`]) for worlds of 2 and 8 ranks with
/// `local(w)` ranks per node, printed with the `expected` ratios; `var` names the
/// size that varies.
fn ratio_8_to_2(hop: &str, var: &str, local: fn(usize) -> usize, expected: &str) -> f64 {
    let v2 = mean_sq_error(2, local(2));
    let v8 = mean_sq_error(8, local(8));
    let ratio = v8 / v2;
    eprintln!("{hop}: V({var}=2) = {v2:.3e}, V({var}=8) = {v8:.3e}, ratio {ratio:.3} ({expected})");
    ratio
}

/// Intra-node sums (one node of L ranks). Independent draws: the mean of L
/// errors of variance σ² has variance σ²/L, so V(8)/V(2) = 1/4; one shared draw
/// per element gives every rank the same error, so V(8)/V(2) = 1.
///
/// False-failure probability: each V is a mean of ~32k squared errors, each at
/// most (1/8)² with a variance below its squared mean × 2, so V's relative standard
/// error is under 1% and the threshold 1/2 sits more than 25 standard errors above
/// the expected 1/4. Chebyshev bounds the chance of such a deviation of either
/// estimate by 2/25² < 0.4% for an arbitrary seed; the normal approximation puts it
/// below 1e-100. The seeds are fixed, so the test is deterministic.
#[test]
fn intra_node_error_variance_grows_linearly() {
    let ratio = ratio_8_to_2("intra", "L", |w| w, "independent 0.25, correlated 1.0");
    assert!(ratio < 0.5, "error variance of the mean did not shrink with L: ratio {ratio}");
    assert!(ratio > 0.15, "ratio {ratio} is far below the independent 0.25: errors anti-correlated?");
}

/// Inter-node sums (N nodes of one rank): the own shard is exact, the N-1 others
/// are quantized once. Independent: V ∝ (N-1)/N², so V(8)/V(2) = 7/16; shared
/// draws: V ∝ ((N-1)/N)², so V(8)/V(2) = 49/16. Same false-failure argument.
#[test]
fn inter_node_error_variance_grows_linearly() {
    let ratio = ratio_8_to_2("inter", "N", |_| 1, "independent 0.44, correlated 3.06");
    assert!(ratio < 1.0, "error variance grew like N^2: ratio {ratio}");
}

/// LoCo on both hops: averaged over many steps, error feedback removes most of
/// the quantization error of the time-averaged gradient, on a 2x2 cluster where
/// both hops quantize. β = 0.8 (DeepSpeed's default) must do it too.
#[test]
fn loco_feedback_shrinks_the_time_averaged_error_on_both_hops() {
    let t = Topology::ranks(4).per_node(2).unwrap();
    let n = 4096;
    let steps = 32;
    let grads: Vec<Vec<f32>> = (0..4)
        .map(|r| {
            (0..n)
                .map(|i| {
                    let u = (splitmix64((r * n + i) as u64) >> 40) as f32 / (1u64 << 24) as f32;
                    (2.0 * u - 1.0) * if i % 64 == 0 { 8.0 } else { 1.0 }
                })
                .collect()
        })
        .collect();
    let exact: Vec<f64> = (0..n).map(|i| grads.iter().map(|g| f64::from(g[i])).sum::<f64>() / 4.0).collect();
    let run = |fb: Option<f32>, precision: ResidualPrecision| -> f64 {
        let outs = ThreadCluster::new(t, ThreadOptions::default())
            .run(|comm| {
                let r = comm.rank();
                let mut acc = vec![0.0f64; n / 4];
                let mut feedback = fb.map(|b| ErrorFeedback::loco(b).with_precision(precision));
                for _ in 0..steps {
                    let mut shard = vec![0.0f32; n / 4];
                    match feedback.as_mut() {
                        Some(f) => qgz_reduce_scatter_with_feedback(
                            comm,
                            &grads[r],
                            &mut shard,
                            &QgzOptions::default(),
                            f,
                        )?,
                        None => qgz_reduce_scatter(comm, &grads[r], &mut shard, &QgzOptions::default())?,
                    }
                    acc.iter_mut().zip(&shard).for_each(|(a, &x)| *a += f64::from(x));
                }
                if let Some(f) = &feedback {
                    // Both hops kept a residual (2 nodes: hop 2 quantizes), in the
                    // precision asked for.
                    assert_eq!(f.residual().len(), n);
                    assert_eq!(f.inter_residual().len(), n / 4 * 2);
                    assert!(f.inter_residual().iter().any(|&x| x != 0.0), "hop-2 residual never used");
                    assert_eq!(f.bytes(), (n + n / 4 * 2) * precision.bytes());
                }
                Ok::<_, zeropp_comm::CommError>(acc)
            })
            .unwrap();
        let avg: Vec<f64> = outs.concat().iter().map(|a| a / steps as f64).collect();
        (avg.iter().zip(&exact).map(|(a, e)| (a - e).powi(2)).sum::<f64>() / n as f64).sqrt()
    };
    let plain = run(None, ResidualPrecision::F32);
    for precision in [ResidualPrecision::F32, ResidualPrecision::Bf16] {
        let ef = run(Some(0.0), precision);
        let loco = run(Some(0.8), precision);
        eprintln!(
            "time-averaged RMS error ({precision:?} residuals): none {plain:.3e}, feedback {ef:.3e}, LoCo(0.8) {loco:.3e}"
        );
        assert!(ef < 0.25 * plain, "plain feedback, {precision:?}: {ef} vs {plain}");
        assert!(loco < 0.5 * plain, "LoCo, {precision:?}: {loco} vs {plain}");
    }
}

/// Rank `r`'s gradient of `n` elements at step `k`: distinct per rank and step,
/// spread over (-0.8, 0.9).
fn step_gradient(n: usize, r: usize, k: usize) -> Vec<f32> {
    (0..n).map(|i| ((splitmix64((k * 7919 + r * n + i) as u64) >> 40) as f32 / 1e7) - 0.8).collect()
}

/// One qgZ call with error feedback `fb` on step `k`'s [`step_gradient`].
fn feedback_step(
    comm: &mut zeropp_comm::ThreadComm,
    n: usize,
    k: usize,
    shard: &mut [f32],
    fb: &mut ErrorFeedback,
) -> Result<(), zeropp_comm::CommError> {
    let g = step_gradient(n, comm.rank(), k);
    qgz_reduce_scatter_with_feedback(comm, &g, shard, &QgzOptions::default(), fb)
}

/// Runs `f` on every rank of 2 nodes x 2 and returns the ranks' results.
fn on_2x2<T: Send>(
    f: impl Fn(&mut zeropp_comm::ThreadComm) -> Result<T, zeropp_comm::CommError> + Sync,
) -> Vec<T> {
    let t = Topology::ranks(4).per_node(2).unwrap();
    ThreadCluster::new(t, ThreadOptions::default()).run(f).unwrap()
}

/// bf16 residuals are bf16 values (so they take half the bytes) and track the
/// f32 ones: after four steps on the same gradients, the two runs' residuals and
/// reduced shards stay close.
#[test]
fn bf16_residuals_are_bf16_values_close_to_f32_ones() {
    let n: usize = 2048;
    let outs = on_2x2(|comm| {
        let s = n / 4;
        let mut a = ErrorFeedback::loco(0.8);
        let mut b = ErrorFeedback::loco(0.8).with_precision(ResidualPrecision::Bf16);
        let (mut sa, mut sb) = (vec![0.0f32; s], vec![0.0f32; s]);
        for k in 0..4 {
            feedback_step(comm, n, k, &mut sa, &mut a)?;
            feedback_step(comm, n, k, &mut sb, &mut b)?;
        }
        Ok::<_, zeropp_comm::CommError>((a, b, sa, sb))
    });
    for (a, b, sa, sb) in outs {
        assert_eq!(b.precision(), ResidualPrecision::Bf16);
        assert_eq!(b.bytes() * 2, a.bytes(), "bf16 residuals take half the bytes");
        let (ra, rb) = (a.residual(), b.residual());
        assert_eq!(ra.len(), rb.len());
        let scale = ra.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let mut close = 0usize;
        for (&x, &y) in ra.iter().zip(rb.iter()) {
            assert_eq!(bf16::from_f32(y).to_f32(), y, "a stored residual is not a bf16 value");
            // A few bf16 roundings apart; an element whose rounding decision
            // flipped (a tiny difference crossing a quantization midpoint) jumps by
            // a quantization step instead, which the count below allows for.
            if (x - y).abs() <= x.abs() / 32.0 + scale / 1024.0 {
                close += 1;
            }
        }
        assert!(close * 10 >= ra.len() * 9, "bf16 residuals drifted: {close} of {} close", ra.len());
        // The reduced shards agree to quantization accuracy.
        let diff = sa.iter().zip(&sb).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        let amax = sa.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert!(diff <= 0.25 * amax, "bf16 vs f32 residuals: shards differ by {diff} (amax {amax})");
    }
}

/// Restoring f32 residuals into bf16 storage rounds them to bf16 once;
/// reading them back is exact, and a second round trip changes nothing.
#[test]
fn bf16_residual_state_round_trips_exactly() {
    let mut fb = ErrorFeedback::loco(0.5).with_precision(ResidualPrecision::Bf16);
    let h1: Vec<f32> = (0..100).map(|i| (i as f32 * 0.1234567).sin()).collect();
    let h2: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7654321).cos()).collect();
    fb.restore(h1.clone(), h2.clone());
    let (a1, a2) = fb.state();
    for (x, y) in h1.iter().zip(a1.iter()) {
        assert_eq!(*y, bf16::from_f32(*x).to_f32());
    }
    assert_eq!(a2.len(), h2.len());
    let mut again = ErrorFeedback::loco(0.5).with_precision(ResidualPrecision::Bf16);
    again.restore(a1.to_vec(), a2.to_vec());
    assert_eq!(again, fb);
    assert_eq!(fb.bytes(), 150 * 2);
    // Converting the storage keeps the values (bf16 -> f32 is exact).
    let f32_copy = fb.clone().with_precision(ResidualPrecision::F32);
    assert_eq!(f32_copy.residual(), fb.residual());
    assert_eq!(f32_copy.bytes(), 150 * 4);
}

/// The residuals can be saved and restored: two runs, one of which restores the
/// other's state half way, give bit-identical shards.
#[test]
fn feedback_state_round_trips() {
    let n: usize = 1000;
    let outs = on_2x2(|comm| {
        let s = n.div_ceil(4);
        let mut a = ErrorFeedback::loco(0.8);
        let mut shard = vec![0.0f32; s];
        for k in 0..3 {
            feedback_step(comm, n, k, &mut shard, &mut a)?;
        }
        let (h1, h2) = a.state();
        let mut b = ErrorFeedback::loco(0.8);
        b.restore(h1.to_vec(), h2.to_vec());
        drop((h1, h2));
        let mut sa = vec![0.0f32; s];
        let mut sb = vec![0.0f32; s];
        feedback_step(comm, n, 3, &mut sa, &mut a)?;
        feedback_step(comm, n, 3, &mut sb, &mut b)?;
        Ok::<_, zeropp_comm::CommError>((sa, sb, a == b))
    });
    for (a, b, same) in outs {
        assert_eq!(
            a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert!(same);
    }
}

/// Positions every rank sends as zero (the engine zeroes the 1-D parameters it
/// reduces densely) keep a zero residual on both hops, step after step: error
/// feedback adds nothing there for the dense exchange to fight with.
#[test]
fn zeroed_positions_keep_zero_residuals() {
    let t = Topology::ranks(8).per_node(4).unwrap();
    let n = 8 * 512;
    // Elements [1000, 1300) and the whole of shard 5 are zero on every rank.
    let zero = |i: usize| (1000..1300).contains(&i) || (5 * 512..6 * 512).contains(&i);
    let outs = ThreadCluster::new(t, ThreadOptions::default())
        .run(|comm| {
            let r = comm.rank();
            let mut fb = ErrorFeedback::loco(0.8);
            let mut shard = vec![0.0f32; 512];
            for k in 0..5u64 {
                let g: Vec<f32> = (0..n)
                    .map(|i| {
                        if zero(i) {
                            0.0
                        } else {
                            ((splitmix64(k * 1_000_003 + (r * n + i) as u64) >> 40) as f32 / 1e7) - 0.8
                        }
                    })
                    .collect();
                qgz_reduce_scatter_with_feedback(comm, &g, &mut shard, &QgzOptions::default(), &mut fb)?;
            }
            Ok::<_, zeropp_comm::CommError>((fb.residual().into_owned(), fb.inter_residual().into_owned(), r))
        })
        .unwrap();
    for (hop1, hop2, r) in outs {
        assert!(hop1.iter().any(|&x| x != 0.0), "rank {r}: no residual at all");
        for (i, &e) in hop1.iter().enumerate().filter(|&(i, _)| zero(i)) {
            assert_eq!(e, 0.0, "rank {r}: hop-1 residual {e} at zeroed position {i}");
        }
        // Hop 2 holds one 512-element slot per node for shard (node, local rank of r):
        // rank r's own local rank l gives shards l and 4 + l; shard 5 is all zero.
        let l = r % 4;
        for (m, slot) in hop2.chunks(512).enumerate() {
            let part = m * 4 + l;
            for (k, &e) in slot.iter().enumerate() {
                if zero(part * 512 + k) {
                    assert_eq!(
                        e, 0.0,
                        "rank {r}: hop-2 residual {e} at zeroed element {} of shard {part}",
                        k
                    );
                }
            }
        }
    }
}
