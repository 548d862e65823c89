//! The conformance suite on the thread backend, over random topologies and lengths.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap

use proptest::prelude::*;
use zeropp_comm::conformance::{Case, run_all};
use zeropp_comm::{ThreadCluster, ThreadOptions, Topology};

fn run(world: usize, local: usize, case: Case) -> Result<(), String> {
    let t = Topology::ranks(world).per_node(local).map_err(|e| e.to_string())?;
    let cluster =
        ThreadCluster::new(t, ThreadOptions::default().with_timeout(std::time::Duration::from_secs(20)));
    cluster.run(|comm| run_all(comm, &case)).map(|_| ()).map_err(|e| e.to_string())
}

/// (world, local_size) with local_size dividing world, world in 1..=16.
fn topology() -> impl Strategy<Value = (usize, usize)> {
    (1usize..=16).prop_flat_map(|w| {
        let divisors: Vec<usize> = (1..=w).filter(|d| w % d == 0).collect();
        (Just(w), proptest::sample::select(divisors))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn suite_on_random_topologies((world, local) in topology(), len in prop_oneof![Just(0usize), Just(1), Just(2), Just(7), Just(13), Just(31), 0usize..300], seed in any::<u64>()) {
        prop_assert_eq!(run(world, local, Case { seed, len }), Ok(()));
    }
}

#[test]
fn suite_on_fixed_shapes() {
    for (w, l) in [(1, 1), (2, 1), (2, 2), (4, 2), (6, 3), (8, 4), (8, 1), (16, 4)] {
        for len in [0, 1, 5, 97] {
            assert_eq!(run(w, l, Case { seed: 42, len }), Ok(()), "world {w} local {l} len {len}");
        }
    }
}

#[test]
fn suite_large_length() {
    assert_eq!(run(8, 4, Case { seed: 3, len: 20_011 }), Ok(()));
}
