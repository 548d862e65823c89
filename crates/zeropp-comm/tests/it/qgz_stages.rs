//! [`QgzStages`], the transport-free qgZ, run by hand (the two all-to-alls done
//! by copying bytes between the ranks' buffers) gives the same shards, bit for
//! bit, as [`qgz_reduce_scatter`] on the thread backend: the Python bindings
//! rely on this to reduce exactly like the engine.

use proptest::prelude::*;
use zeropp_comm::collectives::{QgzOptions, QgzStages, qgz_reduce_scatter, shard_len};
use zeropp_comm::{ThreadCluster, ThreadOptions, Topology};
use zeropp_quant::rng::splitmix64;

fn grad(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let u = (splitmix64((rank * 1_000_003 + i) as u64) >> 40) as f32 / (1u64 << 24) as f32;
            (2.0 * u - 1.0) * (1.0 + (i % 7) as f32)
        })
        .collect()
}

/// All ranks' shards through the stages, with the all-to-alls done by hand.
fn by_hand(t: &Topology, n: usize, opts: &QgzOptions) -> Vec<Vec<f32>> {
    let (w, nodes, local) = (t.world(), t.nodes(), t.local_size());
    let st: Vec<QgzStages> = (0..w).map(|r| QgzStages::new(t, r, n, opts).unwrap()).collect();
    let (ia, ie) = (st[0].intra_chunk_len(), st[0].inter_chunk_len());
    let mut intra_send = vec![vec![0u8; local * ia]; w];
    let mut own = vec![vec![0u8; st[0].own_len()]; w];
    let mut inter_send = vec![vec![0u8; nodes * ie]; w];
    let mut shard = vec![vec![0f32; shard_len(n, w)]; w];
    for r in 0..w {
        st[r].pack(&grad(r, n), &mut intra_send[r], &mut own[r], &mut inter_send[r], &mut shard[r]).unwrap();
    }
    // Intra-node all-to-all: rank (m, l) receives chunk l of each local peer (m, j), at slot j.
    for r in 0..w {
        let (m, l) = (t.node_of(r), t.local_rank(r));
        let mut recv = vec![0u8; local * ia];
        for j in 0..local {
            let src = &intra_send[t.rank_of(m, j)][l * ia..(l + 1) * ia];
            recv[j * ia..(j + 1) * ia].copy_from_slice(src);
        }
        st[r].reduce_intra(&recv, &own[r], &mut inter_send[r], &mut shard[r]).unwrap();
    }
    // Rail all-to-all: rank (m, l) receives chunk m of each rail peer (m', l), at slot m'.
    for r in 0..w {
        let (m, l) = (t.node_of(r), t.local_rank(r));
        let mut recv = vec![0u8; nodes * ie];
        for k in 0..nodes {
            recv[k * ie..(k + 1) * ie].copy_from_slice(&inter_send[t.rank_of(k, l)][m * ie..(m + 1) * ie]);
        }
        st[r].finish(&recv, &mut shard[r]).unwrap();
    }
    shard
}

fn on_threads(t: &Topology, n: usize, opts: &QgzOptions) -> Vec<Vec<f32>> {
    let opts = *opts;
    ThreadCluster::new(*t, ThreadOptions::default())
        .run(move |comm| {
            let mut shard = vec![0f32; shard_len(n, comm.topology().world())];
            qgz_reduce_scatter(comm, &grad(comm.rank(), n), &mut shard, &opts)?;
            Ok::<_, zeropp_comm::CommError>(shard)
        })
        .unwrap()
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter().map(|s| s.iter().map(|x| x.to_bits()).collect()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn stages_by_hand_equal_the_collective(
        shape in prop::sample::select(vec![(1, 1), (1, 3), (3, 1), (2, 2), (2, 3), (3, 2)]),
        n in 1usize..3000,
        seed in prop::option::of(any::<u64>()),
        hadamard in prop::option::of(any::<u64>()),
    ) {
        let t = Topology::ranks(shape.0 * shape.1).per_node(shape.1).unwrap();
        let mut opts = QgzOptions::default();
        if let Some(h) = hadamard {
            // SDP4Bit's two levels, rotated (groups of 64: short shards still rotate).
            opts = QgzOptions::two_level(64).unwrap().with_hadamard(h);
        }
        if let Some(seed) = seed {
            opts.quant = opts.quant.stochastic(seed);
        }
        prop_assert_eq!(bits(&by_hand(&t, n, &opts)), bits(&on_threads(&t, n, &opts)));
    }
}

#[test]
fn stages_name_the_buffer_that_does_not_fit() {
    let t = Topology::ranks(4).per_node(2).unwrap();
    let st = QgzStages::new(&t, 1, 1000, &QgzOptions::default()).unwrap();
    let g = vec![0.5f32; 1000];
    let mut shard = vec![0f32; st.shard_len()];
    let mut own = vec![0u8; st.own_len()];
    let mut inter = vec![0u8; 2 * st.inter_chunk_len()];
    let mut short = vec![0u8; 2 * st.intra_chunk_len() - 1];
    let e = st.pack(&g, &mut short, &mut own, &mut inter, &mut shard).unwrap_err().to_string();
    assert!(e.contains("intra-node send buffer"), "{e}");
    let e = st.pack(&g[..999], &mut short, &mut own, &mut inter, &mut shard).unwrap_err().to_string();
    assert!(e.contains("gradient"), "{e}");
    // Garbage where an encoding should be is a decode error, not a wrong sum.
    let recv = vec![7u8; 2 * st.intra_chunk_len()];
    assert!(st.reduce_intra(&recv, &own, &mut inter, &mut shard).is_err());
    assert!(QgzStages::new(&t, 4, 1000, &QgzOptions::default()).is_err());
    // The rotation needs one power-of-two group size on every hop.
    let mixed = QgzOptions {
        local_spec: zeropp_quant::QuantSpec::int8(128).unwrap(),
        ..QgzOptions::two_level(64).unwrap()
    };
    let e = QgzStages::new(&t, 1, 1000, &mixed.with_hadamard(1)).unwrap_err().to_string();
    assert!(e.contains("one group size for every hop (intra 64, inter 64, local 128)"), "{e}");
    let odd = QgzOptions::default().with_spec(zeropp_quant::QuantSpec::int4(100).unwrap());
    let odd = QgzOptions { local_spec: zeropp_quant::QuantSpec::int8(100).unwrap(), ..odd };
    let e = QgzStages::new(&t, 1, 1000, &odd.with_hadamard(1)).unwrap_err().to_string();
    assert!(e.contains("power-of-two group size"), "{e}");
}
