//! `Reduce::Mean` divides the sum by the world size (correctly rounded), rather
//! than multiplying by a rounded `1/W`.
//!
//! The inputs are small integers, so every f32 sum (in any order, bf16 wire
//! included) is exact, and the mean must equal `sum / W` bit for bit. The data is
//! checked to contain sums where `sum * (1/W) != sum / W`, so a multiply fails.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap

use zeropp_comm::collectives::{
    DenseWire, Reduce, Routing, dense_reduce_scatter, reduce_scatter, shard_len, world_reduce_scatter,
};
use zeropp_comm::{Group, ThreadCluster, ThreadOptions, Topology};
use zeropp_quant::rng::splitmix64;

/// Integers in [-40, 40]: exact in bf16, and so is every partial or total sum of up
/// to 6 of them (|sum| <= 240 < 256), so every routing and wire sums exactly.
fn input(rank: usize, i: usize) -> f32 {
    (splitmix64(((rank as u64) << 32) ^ i as u64) % 81) as f32 - 40.0
}

fn check(world: usize, local: usize) {
    let t = Topology::ranks(world).per_node(local).unwrap();
    let n = 1001;
    let s = shard_len(n, world);
    let outs = ThreadCluster::new(t, ThreadOptions::default())
        .run(|comm| -> Result<_, zeropp_comm::CommError> {
            let r = comm.rank();
            let full: Vec<f32> = (0..n).map(|i| input(r, i)).collect();
            let g = Group::world(&t);
            let mut a = vec![0.0; s];
            reduce_scatter(comm, &g, &full, &mut a, Reduce::Mean)?;
            let mut b = vec![0.0; s];
            dense_reduce_scatter(comm, &g, DenseWire::Bf16, &full, &mut b, Reduce::Mean)?;
            let mut v = vec![a, b];
            for routing in Routing::ALL {
                for wire in DenseWire::ALL {
                    let mut c = vec![0.0; s];
                    world_reduce_scatter(comm, routing, wire, &full, &mut c, Reduce::Mean)?;
                    v.push(c);
                }
            }
            Ok(v)
        })
        .unwrap();
    let w = world as f32;
    let mut differs = 0;
    for (r, per_op) in outs.iter().enumerate() {
        for out in per_op {
            for (k, &y) in out.iter().enumerate() {
                let i = r * s + k;
                let sum: f32 = if i < n { (0..world).map(|q| input(q, i)).sum() } else { 0.0 };
                assert_eq!(y.to_bits(), (sum / w).to_bits(), "world {world}: element {i} sum {sum}: got {y}");
                if sum * (1.0 / w) != sum / w {
                    differs += 1;
                }
            }
        }
    }
    assert!(differs > 0, "world {world}: no element where multiplying by 1/W is wrong; the test cannot fail");
}

#[test]
fn mean_divides_by_world_3x1() {
    check(3, 1);
}

#[test]
fn mean_divides_by_world_2x3() {
    check(6, 3);
}
