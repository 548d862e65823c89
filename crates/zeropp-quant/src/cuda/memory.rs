//! [`Gpu`]'s device memory: zeroed buffers, uploads and downloads of
//! values and of quantized encodings (wire bytes), on the handle's stream.

use super::*;

impl Gpu {
    /// `bytes` bytes of zeroed device memory padded to whole words
    /// ([`padded_bytes`]), zeroed on this handle's stream (stream-ordered, not
    /// on the legacy stream); nothing is allocated for 0 bytes. Later work on
    /// this stream sees the zeros; other streams must wait for it.
    pub fn zeroed_bytes(&self, bytes: usize) -> Result<DeviceBuffer<u8>> {
        self.current()?;
        let mut b = alloc::<u8>(padded_bytes(bytes))?;
        if !b.is_empty() {
            // SAFETY: `b` is a live allocation of this context; the memset is
            // ordered on this stream before any use the callers make of it.
            unsafe { b.set_zero_async(&self.stream)? };
        }
        Ok(b)
    }

    /// Copies `x` into new device memory on this stream and waits for it.
    fn copy_to_device<T: DeviceCopy>(&self, x: &[T]) -> Result<DeviceBuffer<T>> {
        let mut b = alloc::<T>(x.len())?;
        if !x.is_empty() {
            // SAFETY: `b` holds `x.len()` elements; the stream is synchronized
            // before `x` can go away.
            unsafe { b.async_copy_from(x, &self.stream)? };
            self.stream.synchronize()?;
        }
        Ok(b)
    }

    /// Copies `x` to the device.
    pub fn upload<T: GpuElement>(&self, x: &[T]) -> Result<GpuVec<T>> {
        self.current()?;
        let raw: Vec<T::Raw> = x.iter().map(|&v| v.raw()).collect();
        Ok(GpuVec {
            buf: ManuallyDrop::new(self.copy_to_device(&raw)?),
            ctx: ManuallyDrop::new(self.ctx.clone()),
            _t: PhantomData,
        })
    }

    /// Copies a device f32 buffer to the host, after this stream's earlier work.
    pub fn download(&self, x: &DeviceSlice<f32>) -> Result<Vec<f32>> {
        self.current()?;
        let mut v = vec![0f32; x.len()];
        if !x.is_empty() {
            // SAFETY: `v` holds `x.len()` floats and outlives the copy: the stream
            // is synchronized before it is returned.
            unsafe { x.async_copy_to(&mut v[..], &self.stream)? };
            self.stream.synchronize()?;
        }
        Ok(v)
    }

    /// Copies a quantized value (owned or a view of received wire bytes) to the device.
    pub fn upload_quantized<Q: AsQuantizedRef + ?Sized>(&self, q: &Q) -> Result<GpuQuantized> {
        let q = q.as_quantized_ref();
        self.wire_buffer(q.spec(), q.len(), &q.to_bytes())
    }

    /// Checks wire bytes (every check of [`QuantizedRef::from_bytes`]) and copies them to the device.
    pub fn upload_wire(&self, bytes: &[u8]) -> Result<GpuQuantized> {
        let q = QuantizedRef::from_bytes(bytes)?;
        self.wire_buffer(q.spec(), q.len(), bytes)
    }

    /// A padded device copy of the encoding `bytes` (`len` elements in `spec`).
    fn wire_buffer(&self, spec: QuantSpec, len: usize, bytes: &[u8]) -> Result<GpuQuantized> {
        self.current()?;
        let mut padded = bytes.to_vec();
        padded.resize(padded_bytes(bytes.len()), 0);
        Ok(GpuQuantized {
            spec,
            len,
            bytes: bytes.len(),
            buf: ManuallyDrop::new(self.copy_to_device(&padded)?),
            ctx: ManuallyDrop::new(self.ctx.clone()),
        })
    }

    /// A device buffer of `len` f32 zeros (a destination for dequantization),
    /// zeroed on this stream; nothing is allocated when `len` is 0. Drop it where
    /// this GPU's context is current (any call of this [`Gpu`] makes it current).
    pub fn zeros(&self, len: usize) -> Result<DeviceBuffer<f32>> {
        self.current()?;
        let mut b = alloc::<f32>(len)?;
        if len > 0 {
            // SAFETY: a live allocation of this context, zeroed in stream order
            // and waited for before it is returned.
            unsafe { b.set_zero_async(&self.stream)? };
            self.stream.synchronize()?;
        }
        Ok(b)
    }

    /// A quantized destination of `len` elements in `spec` on the device: the
    /// header is written, the rest is zero (not a valid value until a
    /// `*_into` call fills it). For [`Gpu::quantize_into`] and
    /// [`Gpu::dequant_reduce_quant_into`], which reuse it without allocating.
    pub fn quantized_buffer(&self, spec: QuantSpec, len: usize) -> Result<GpuQuantized> {
        let total = wire::checked_encoded_len(&spec, len).ok_or(QuantError::TooLarge(len as u64))?;
        let mut bytes = vec![0u8; total];
        let header = bytes.get_mut(..wire::HEADER_LEN).ok_or(QuantError::TooLarge(len as u64))?;
        wire::write_header(header, &spec, len)?;
        self.wire_buffer(spec, len, &bytes)
    }
}
