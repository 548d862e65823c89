//! The two implementations the suite checks the ZeRO++ collectives on, behind
//! one interface over host slices: [`HostPath`] runs the host collectives
//! (`crate::collectives`) on any [`Communicator`]; [`DevicePath`] runs the
//! device collectives (`crate::device::collectives`) on any
//! [`DeviceCommunicator`], uploading the inputs and downloading the results
//! around each call. The checks that take a [`Collectives`] run unchanged on
//! both, against the same sequential and float64 references.

use half::bf16;
use zeropp_quant::Element;

use crate::collectives::{self as host, DeltaOptions, DenseWire, QgzOptions, QwzOptions, Reduce, Routing};
use crate::device::{Device, DeviceBuf, DeviceCommunicator, Elem, View, collectives as dev};
use crate::{CommError, Communicator, Group, Topology};

/// The element type of an hpZ copy that qwZ-Δ updates: f32 or bf16.
pub trait CopyElem: Element + bytemuck::Pod {
    /// The device element type of the same values.
    const ELEM: Elem;
}

impl CopyElem for f32 {
    const ELEM: Elem = Elem::F32;
}

impl CopyElem for bf16 {
    const ELEM: Elem = Elem::Bf16;
}

/// What a collective returns: its output is written into the caller's slice.
type Done = Result<(), CommError>;

/// The ZeRO++ collectives that have both a host and a device implementation,
/// called on host slices with the host functions' contracts (lengths, shard
/// layout, errors as [`CommError`]).
pub trait Collectives {
    /// The cluster's topology.
    fn topology(&self) -> Topology;
    /// This rank.
    fn rank(&self) -> usize;
    /// [`host::qgz_reduce_scatter`].
    fn qgz_reduce_scatter(&mut self, grad: &[f32], out: &mut [f32], opts: &QgzOptions) -> Done;
    /// [`host::qwz_all_gather`] from and to f32.
    fn qwz_all_gather(&mut self, g: &Group, shard: &[f32], full: &mut [f32], opts: &QwzOptions) -> Done;
    /// [`host::qwz_all_gather`] from f32 into bf16.
    fn qwz_all_gather_bf16(&mut self, g: &Group, s: &[f32], full: &mut [bf16], o: &QwzOptions) -> Done;
    /// [`host::dense_reduce_scatter`] with [`DenseWire::Bf16`].
    fn reduce_scatter_bf16_wire(&mut self, g: &Group, full: &[f32], shard: &mut [f32], r: Reduce) -> Done;
    /// [`host::all_gather_f32_via_bf16`].
    fn all_gather_via_bf16(&mut self, g: &Group, shard: &[f32], full: &mut [f32]) -> Done;
    /// [`host::world_all_gather`].
    fn world_all_gather(&mut self, r: Routing, w: DenseWire, shard: &[f32], full: &mut [f32]) -> Done;
    /// [`host::world_qwz_all_gather`] from and to f32.
    fn world_qwz_all_gather(&mut self, r: Routing, shard: &[f32], full: &mut [f32], o: &QwzOptions) -> Done;
    /// [`host::world_reduce_scatter`].
    fn world_reduce_scatter(
        &mut self,
        r: Routing,
        w: DenseWire,
        full: &[f32],
        s: &mut [f32],
        op: Reduce,
    ) -> Done;
    /// [`host::delta_encode`]: returns the encoding's length in `out`.
    fn delta_encode<T: CopyElem>(
        &mut self,
        w: &[f32],
        w_hat: &mut [T],
        opts: &DeltaOptions,
        out: &mut [u8],
    ) -> Result<usize, CommError>;
    /// [`host::delta_apply`].
    fn delta_apply<T: CopyElem>(&mut self, w_hat: &mut [T], enc: &[u8], opts: &DeltaOptions) -> Done;
    /// [`host::qwz_delta_exchange`].
    fn qwz_delta_exchange(&mut self, hpz: usize, delta: &[u8]) -> Result<Vec<u8>, CommError>;
}

/// The host collectives on a [`Communicator`].
///
/// ```
/// use zeropp_comm::conformance::{Case, HostPath, run_collectives};
/// use zeropp_comm::{ThreadCluster, ThreadOptions, Topology};
/// let cluster = ThreadCluster::new(Topology::ranks(4).per_node(2)?, ThreadOptions::default());
/// cluster.run(|comm| run_collectives(&mut HostPath(comm), &Case { seed: 7, len: 13 }))?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct HostPath<'a, C: ?Sized>(pub &'a mut C);

impl<C: Communicator + ?Sized> Collectives for HostPath<'_, C> {
    fn topology(&self) -> Topology {
        *self.0.topology()
    }
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn qgz_reduce_scatter(&mut self, grad: &[f32], out: &mut [f32], opts: &QgzOptions) -> Done {
        host::qgz_reduce_scatter(self.0, grad, out, opts)
    }
    fn qwz_all_gather(&mut self, g: &Group, shard: &[f32], full: &mut [f32], opts: &QwzOptions) -> Done {
        host::qwz_all_gather(self.0, g, shard, full, opts)
    }
    fn qwz_all_gather_bf16(&mut self, g: &Group, s: &[f32], full: &mut [bf16], o: &QwzOptions) -> Done {
        host::qwz_all_gather(self.0, g, s, full, o)
    }
    fn reduce_scatter_bf16_wire(&mut self, g: &Group, full: &[f32], shard: &mut [f32], r: Reduce) -> Done {
        host::dense_reduce_scatter(self.0, g, DenseWire::Bf16, full, shard, r)
    }
    fn all_gather_via_bf16(&mut self, g: &Group, shard: &[f32], full: &mut [f32]) -> Done {
        host::all_gather_f32_via_bf16(self.0, g, shard, full)
    }
    fn world_all_gather(&mut self, r: Routing, w: DenseWire, shard: &[f32], full: &mut [f32]) -> Done {
        host::world_all_gather(self.0, r, w, shard, full)
    }
    fn world_qwz_all_gather(&mut self, r: Routing, shard: &[f32], full: &mut [f32], o: &QwzOptions) -> Done {
        host::world_qwz_all_gather(self.0, r, shard, full, o)
    }
    fn world_reduce_scatter(
        &mut self,
        r: Routing,
        w: DenseWire,
        x: &[f32],
        y: &mut [f32],
        op: Reduce,
    ) -> Done {
        host::world_reduce_scatter(self.0, r, w, x, y, op)
    }
    fn delta_encode<T: CopyElem>(
        &mut self,
        w: &[f32],
        w_hat: &mut [T],
        opts: &DeltaOptions,
        out: &mut [u8],
    ) -> Result<usize, CommError> {
        host::delta_encode(w, w_hat, opts, out)
    }
    fn delta_apply<T: CopyElem>(&mut self, w_hat: &mut [T], enc: &[u8], opts: &DeltaOptions) -> Done {
        host::delta_apply(w_hat, enc, opts)
    }
    fn qwz_delta_exchange(&mut self, hpz: usize, delta: &[u8]) -> Result<Vec<u8>, CommError> {
        host::qwz_delta_exchange(self.0, hpz, delta)
    }
}

/// The device collectives on a [`DeviceCommunicator`] (its device and
/// stream), with the host slices uploaded before and downloaded after each call.
///
/// ```
/// use zeropp_comm::conformance::{Case, DevicePath, run_collectives};
/// use zeropp_comm::device::{DeviceCluster, HostDevice};
/// use zeropp_comm::{ThreadOptions, Topology};
/// let cluster = DeviceCluster::new(Topology::ranks(4).per_node(2)?, HostDevice, ThreadOptions::default());
/// cluster.run(|comm| run_collectives(&mut DevicePath(comm), &Case { seed: 7, len: 13 }))?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct DevicePath<'a, C: ?Sized>(pub &'a mut C);

impl<C: DeviceCommunicator + ?Sized> DevicePath<'_, C> {
    fn up<T: bytemuck::Pod>(&self, x: &[T]) -> Result<DeviceBuf<C::Device>, CommError> {
        DeviceBuf::from_bytes(self.0.device(), self.0.stream(), bytemuck::cast_slice(x))
    }

    /// A zeroed buffer of the bytes of `like`.
    fn out<T: bytemuck::Pod>(&self, like: &[T]) -> Result<DeviceBuf<C::Device>, CommError> {
        DeviceBuf::zeroed(self.0.device(), std::mem::size_of_val(like))
    }

    /// Downloads `buf` into `dst` (of the same byte length).
    fn down<T: bytemuck::Pod>(&self, buf: &DeviceBuf<C::Device>, dst: &mut [T]) -> Done {
        self.0.device().download(self.0.stream(), buf.view(), bytemuck::cast_slice_mut(dst))
    }

    /// Uploads `input`, runs `call` on it and a zeroed output buffer of
    /// `output`'s bytes, and downloads that buffer into `output`.
    fn through<I: bytemuck::Pod, O: bytemuck::Pod>(
        &mut self,
        input: &[I],
        output: &mut [O],
        call: impl FnOnce(&mut C, View<'_, C::Device>, View<'_, C::Device>) -> Done,
    ) -> Done {
        let (i, o) = (self.up(input)?, self.out(output)?);
        call(self.0, i.view(), o.view())?;
        self.down(&o, output)
    }
}

impl<C: DeviceCommunicator + ?Sized> Collectives for DevicePath<'_, C> {
    fn topology(&self) -> Topology {
        *self.0.topology()
    }
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn qgz_reduce_scatter(&mut self, grad: &[f32], out: &mut [f32], opts: &QgzOptions) -> Done {
        self.through(grad, out, |c, g, o| dev::qgz_reduce_scatter(c, g, o, opts))
    }
    fn qwz_all_gather(&mut self, g: &Group, shard: &[f32], full: &mut [f32], opts: &QwzOptions) -> Done {
        self.through(shard, full, |c, s, f| dev::qwz_all_gather(c, g, s, Elem::F32, f, Elem::F32, opts))
    }
    fn qwz_all_gather_bf16(&mut self, g: &Group, s: &[f32], full: &mut [bf16], o: &QwzOptions) -> Done {
        self.through(s, full, |c, s, f| dev::qwz_all_gather(c, g, s, Elem::F32, f, Elem::Bf16, o))
    }
    fn reduce_scatter_bf16_wire(&mut self, g: &Group, full: &[f32], shard: &mut [f32], r: Reduce) -> Done {
        self.through(full, shard, |c, f, s| dev::reduce_scatter_bf16_wire(c, g, f, s, r))
    }
    fn all_gather_via_bf16(&mut self, g: &Group, shard: &[f32], full: &mut [f32]) -> Done {
        // The device baseline gathers bf16 shards: the rounding to bf16 is
        // the caller's there, widening the result back to f32 too.
        let narrow: Vec<bf16> = shard.iter().map(|&x| bf16::from_f32(x)).collect();
        let mut wide = vec![bf16::ZERO; full.len()];
        self.through(&narrow, &mut wide, |c, s, f| dev::all_gather_bf16(c, g, s, f))?;
        if full.len() != wide.len() {
            return Err(CommError::Mismatch("all_gather_via_bf16: output length".into()));
        }
        full.iter_mut().zip(&wide).for_each(|(o, x)| *o = x.to_f32());
        Ok(())
    }
    fn world_all_gather(&mut self, r: Routing, w: DenseWire, shard: &[f32], full: &mut [f32]) -> Done {
        self.through(shard, full, |c, s, f| dev::world_all_gather(c, r, w, s, f))
    }
    fn world_qwz_all_gather(&mut self, r: Routing, shard: &[f32], full: &mut [f32], o: &QwzOptions) -> Done {
        self.through(shard, full, |c, s, f| dev::world_qwz_all_gather(c, r, s, Elem::F32, f, Elem::F32, o))
    }
    fn world_reduce_scatter(
        &mut self,
        r: Routing,
        w: DenseWire,
        x: &[f32],
        y: &mut [f32],
        op: Reduce,
    ) -> Done {
        self.through(x, y, |c, f, s| dev::world_reduce_scatter(c, r, w, f, s, op))
    }
    fn delta_encode<T: CopyElem>(
        &mut self,
        w: &[f32],
        w_hat: &mut [T],
        opts: &DeltaOptions,
        out: &mut [u8],
    ) -> Result<usize, CommError> {
        let (wb, hat, o) = (self.up(w)?, self.up(w_hat)?, self.out(out)?);
        let e = dev::delta_encode(self.0, wb.view(), hat.view(), T::ELEM, opts, o.view())?;
        self.down(&hat, w_hat)?;
        self.down(&o, out)?;
        Ok(e)
    }
    fn delta_apply<T: CopyElem>(&mut self, w_hat: &mut [T], enc: &[u8], opts: &DeltaOptions) -> Done {
        let (hat, e) = (self.up(w_hat)?, self.up(enc)?);
        dev::delta_apply(self.0, hat.view(), T::ELEM, e.view(), opts)?;
        self.down(&hat, w_hat)
    }
    fn qwz_delta_exchange(&mut self, hpz: usize, delta: &[u8]) -> Result<Vec<u8>, CommError> {
        let t = *self.0.topology();
        let mut got = vec![0u8; t.world() / hpz.max(1) * delta.len()];
        self.through(delta, &mut got, |c, d, o| dev::qwz_delta_exchange(c, hpz, d, o))?;
        Ok(got)
    }
}
