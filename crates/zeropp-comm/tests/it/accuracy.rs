//! qgZ accuracy: within the analytic bound, and more accurate than the ring that
//! requantizes at every hop.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap

use zeropp_comm::collectives::{
    ErrorFeedback, QgzOptions, RingOptions, qgz_reduce_scatter, qgz_reduce_scatter_with_feedback,
    ring_quantized_reduce_scatter, shard_len,
};
use zeropp_comm::conformance::{qgz_error_bound, rank_data};
use zeropp_comm::{CommError, Group, ThreadCluster, ThreadComm, ThreadOptions, Topology};

/// Runs `f(comm, input)` on a `w`×`l` thread cluster where rank `r`'s input is
/// `rank_data(seed, r, n)`; returns the topology, the inputs and every rank's result.
fn run_on<R: Send>(
    (w, l, n, seed): (usize, usize, usize, u64),
    f: impl Fn(&mut ThreadComm, &[f32]) -> Result<R, CommError> + Sync,
) -> (Topology, Vec<Vec<f32>>, Vec<R>) {
    let t = Topology::ranks(w).per_node(l).unwrap();
    let inputs: Vec<Vec<f32>> = (0..w).map(|r| rank_data(seed, r, n)).collect();
    let outs =
        ThreadCluster::new(t, ThreadOptions::default()).run(|comm| f(comm, &inputs[comm.rank()])).unwrap();
    (t, inputs, outs)
}

/// Returns (qgZ RMS error, ring RMS error) against the exact f64 mean, and checks
/// the analytic bound on every element.
fn errors(w: usize, l: usize, n: usize) -> (f64, f64) {
    let s = shard_len(n, w);
    let (t, inputs, outs) = run_on((w, l, n, 11), |comm, input| {
        let mut a = vec![0.0; s];
        qgz_reduce_scatter(comm, input, &mut a, &QgzOptions::default())?;
        let mut b = vec![0.0; s];
        let world = Group::world(comm.topology());
        ring_quantized_reduce_scatter(comm, &world, input, &mut b, &RingOptions::default())?;
        Ok((a, b))
    });
    let (mut ea, mut eb) = (0.0f64, 0.0f64);
    for (r, (a, b)) in outs.iter().enumerate() {
        let bound = qgz_error_bound(&t, &inputs, &QgzOptions::default(), r);
        for k in 0..s {
            let i = r * s + k;
            let exact =
                if i < n { inputs.iter().map(|x| f64::from(x[i])).sum::<f64>() / w as f64 } else { 0.0 };
            let da = f64::from(a[k]) - exact;
            assert!(da.abs() <= f64::from(bound[k]), "element {i}: error {da} > bound {}", bound[k]);
            ea += da * da;
            eb += (f64::from(b[k]) - exact).powi(2);
        }
    }
    ((ea / n as f64).sqrt(), (eb / n as f64).sqrt())
}

#[test]
fn qgz_beats_the_ring_for_world_of_four_and_more() {
    for (w, l) in [(4, 2), (8, 4), (8, 2), (16, 4), (4, 1), (4, 4)] {
        let (q, r) = errors(w, l, 40_000);
        println!("world {w} local {l}: qgZ rms {q:.3e}, ring rms {r:.3e}, ring/qgZ {:.2}", r / q);
        assert!(q < r, "world {w} local {l}: qgZ {q} not below ring {r}");
    }
}

#[test]
fn error_feedback_reduces_the_accumulated_error() {
    // With a constant gradient, the running average of the qgZ outputs converges
    // to the exact mean with error feedback, and stays biased without it.
    let (w, l, n, steps) = (4, 2, 4096, 16);
    let s = shard_len(n, w);
    let (_, inputs, outs) = run_on((w, l, n, 5), |comm, input| {
        let mut fb = ErrorFeedback::new();
        let (mut with, mut without) = (vec![0.0f64; s], vec![0.0f64; s]);
        let mut out = vec![0.0; s];
        for _ in 0..steps {
            qgz_reduce_scatter_with_feedback(comm, input, &mut out, &QgzOptions::default(), &mut fb)?;
            with.iter_mut().zip(&out).for_each(|(a, b)| *a += f64::from(*b) / steps as f64);
            qgz_reduce_scatter(comm, input, &mut out, &QgzOptions::default())?;
            without.iter_mut().zip(&out).for_each(|(a, b)| *a += f64::from(*b) / steps as f64);
        }
        Ok((with, without))
    });
    let (mut ew, mut eo) = (0.0, 0.0);
    for (r, (with, without)) in outs.iter().enumerate() {
        for k in 0..s {
            let exact = inputs.iter().map(|x| f64::from(x[r * s + k])).sum::<f64>() / w as f64;
            ew += (with[k] - exact).powi(2);
            eo += (without[k] - exact).powi(2);
        }
    }
    println!(
        "error feedback: rms with {:.3e}, without {:.3e}",
        (ew / n as f64).sqrt(),
        (eo / n as f64).sqrt()
    );
    assert!(ew < 0.5 * eo, "with {ew} without {eo}");
}
