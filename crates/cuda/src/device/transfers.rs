//! Buffers and transfers: device buffers, copies to and from the host (pageable and pinned,
//! on the compute stream or the copy stream of op offload), and weight uploads (matrices and
//! expert tensors, the latter also gathered from per-expert parts through [`Staging`]).

use std::sync::PoisonError;

use cudarc::driver::sys::CUresult;
use cudarc::driver::{CudaSlice, DeviceRepr, DriverError, PinnedHostSlice, ValidAsZeroBits};
use hmoe_backend::Elem;
use hmoe_quant::GgmlType;

use super::capabilities::check_type;
use super::{row_bytes, CudaDevice, DeviceExperts, DeviceMatrix};
use crate::error::{ensure, CudaError};
use crate::host_slots::MAX_SLOT_BYTES;
use crate::mem_pool::retry_out_of_memory;
use crate::staging::{self, CopyUpload, Staging};

impl CudaDevice {
    /// `alloc()`, which allocates device memory, and once more after [`Self::make_room`] when
    /// it runs out (`mem_pool.rs`: the pool keeps what is freed).
    fn with_room<T>(&self, alloc: impl FnMut() -> Result<T, DriverError>) -> Result<T, CudaError> {
        Ok(retry_out_of_memory(alloc, || self.make_room())?)
    }

    /// Waits for both streams (so that their queued frees have happened) and hands what the
    /// pool keeps unused back; an error (no second try) where the pool keeps nothing or while
    /// a segment is captured, when the stream must not be waited for.
    fn make_room(&self) -> Result<(), DriverError> {
        match &self.pool {
            Some(pool) if !self.graphs.capturing() => {
                self.stream.synchronize()?;
                self.copy_stream.synchronize()?;
                pool.trim()
            }
            _ => Err(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY)),
        }
    }

    /// A new device buffer holding a copy of `src`.
    pub fn upload<T: DeviceRepr>(&self, src: &[T]) -> Result<CudaSlice<T>, CudaError> {
        self.with_room(|| self.stream.clone_htod(src))
    }

    /// [`CudaDevice::upload`] on the copy stream, for op offload: a copy from pageable memory
    /// waits for its stream's earlier work, which on the compute stream would hold the host
    /// until the layers queued before had run. The buffer lives on the copy stream: its
    /// owner orders it with the compute stream (`MoeWeights`' biases: through the
    /// `CopyUpload` of the experts uploaded after them).
    pub fn upload_for_offload<T: DeviceRepr>(&self, src: &[T]) -> Result<CudaSlice<T>, CudaError> {
        self.with_room(|| self.copy_stream.clone_htod(src))
    }

    /// Copies `src` into the start of `dst` (queued on the stream; `src` is read before this
    /// returns for pageable memory).
    pub fn upload_into<T: DeviceRepr>(
        &self,
        src: &[T],
        dst: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        ensure(dst.len() >= src.len(), "upload_into", || {
            format!("{} elements into a buffer of {}", src.len(), dst.len())
        })?;
        Ok(self.stream.memcpy_htod(src, dst)?)
    }

    /// [`CudaDevice::upload_into`] of exactly `dst.len()` values, through the device's
    /// persistent pinned buffers when it is small (`host_slots.rs`: a step's token ids and
    /// positions), so that it allocates nothing and is one asynchronous copy.
    pub fn upload_into_pinned<T: DeviceRepr + Elem>(
        &self,
        src: &[T],
        dst: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        ensure(dst.len() == src.len(), "upload_into", || {
            format!("{} elements into a buffer of {}", src.len(), dst.len())
        })?;
        if std::mem::size_of_val(src) > MAX_SLOT_BYTES || src.is_empty() {
            return self.upload_into(src, dst);
        }
        let mut slots = self
            .host_slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        slots.upload(&self.ctx, &self.stream, src, dst)
    }

    /// [`CudaDevice::download`] through the device's persistent pinned buffers when `src`
    /// is small (`host_slots.rs`: a decode step's logits).
    pub fn download_pinned<T: DeviceRepr + Elem>(
        &self,
        src: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        if src.num_bytes() > MAX_SLOT_BYTES {
            return self.download(src);
        }
        let mut slots = self
            .host_slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        slots.download(&self.ctx, &self.stream, src)
    }

    /// The bytes `range` of `src` (waits for the queued ops that write it): a K/V ring's rows
    /// read alone.
    pub fn download_range(
        &self,
        src: &CudaSlice<u8>,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<u8>, CudaError> {
        ensure(
            range.start <= range.end && range.end <= src.len(),
            "download_range",
            || format!("range {range:?} of a buffer of {}", src.len()),
        )?;
        let mut out = vec![0u8; range.len()];
        if !out.is_empty() {
            self.stream.memcpy_dtoh(&src.slice(range), &mut out)?;
        }
        self.stream.synchronize()?;
        Ok(out)
    }

    /// Copies `src` into `dst` from byte `at` on, and waits for the copy: a K/V ring's rows
    /// written alone.
    pub fn upload_at(
        &self,
        src: &[u8],
        dst: &mut CudaSlice<u8>,
        at: usize,
    ) -> Result<(), CudaError> {
        let end = at.checked_add(src.len()).filter(|&e| e <= dst.len());
        let Some(end) = end else {
            return Err(CudaError::Shape {
                op: "upload_at",
                what: format!("{} bytes at {at} into a buffer of {}", src.len(), dst.len()),
            });
        };
        if !src.is_empty() {
            self.stream.memcpy_htod(src, &mut dst.slice_mut(at..end))?;
        }
        self.stream.synchronize()?;
        Ok(())
    }

    /// A new device buffer holding a copy of `src[range]` (queued on the stream).
    pub fn copy_range<T: DeviceRepr>(
        &self,
        src: &CudaSlice<T>,
        range: std::ops::Range<usize>,
    ) -> Result<CudaSlice<T>, CudaError> {
        ensure(
            range.start < range.end && range.end <= src.len(),
            "copy_range",
            || format!("range {range:?} of a buffer of {}", src.len()),
        )?;
        self.with_room(|| self.stream.clone_dtod(&src.slice(range.clone())))
    }

    /// A new zeroed device buffer of `len` elements.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        self.with_room(|| self.stream.alloc_zeros(len))
    }

    /// A new device buffer of `len` elements whose contents are unspecified (no memset): the
    /// contract's scratch ([`hmoe_backend::Backend::alloc_scratch`]), which the ops writing it
    /// overwrite whole before anything reads it.
    pub fn alloc_scratch<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>, CudaError> {
        // SAFETY: the memory is left uninitialised; `T` is one of the contract's element
        // types (f32, i32, u16, u8), for which any bits are a value, and the contract's
        // callers (and the ops' own temporaries) write the buffer before they read it.
        self.with_room(|| unsafe { self.stream.alloc::<T>(len) })
    }

    /// The contents of `src` (waits for the queued ops that write it).
    pub fn download<T: DeviceRepr + Clone + Default>(
        &self,
        src: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        let mut out = vec![T::default(); src.len()];
        self.stream.memcpy_dtoh(src, &mut out)?;
        self.stream.synchronize()?;
        Ok(out)
    }

    /// A zeroed page-locked host buffer of `len` elements, for asynchronous copies.
    pub fn alloc_pinned<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<PinnedHostSlice<T>, CudaError> {
        staging::pinned_zeroed(&self.ctx, len)
    }

    /// Queues a copy from pinned host memory to `dst` and returns at once; cudarc's events
    /// keep `src` from being reused before the copy has run.
    pub fn upload_async<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        src: &PinnedHostSlice<T>,
        dst: &mut CudaSlice<T>,
    ) -> Result<(), CudaError> {
        ensure(dst.len() >= src.len(), "upload_async", || {
            format!("{} elements into a buffer of {}", src.len(), dst.len())
        })?;
        Ok(self.stream.memcpy_htod(src, dst)?)
    }

    /// Queues a copy from `src` into pinned host memory and returns at once; reading `dst`
    /// (`as_slice`) waits for the copy.
    pub fn download_async<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        src: &CudaSlice<T>,
        dst: &mut PinnedHostSlice<T>,
    ) -> Result<(), CudaError> {
        ensure(dst.len() >= src.len(), "download_async", || {
            format!("{} elements into a buffer of {}", src.len(), dst.len())
        })?;
        Ok(self.stream.memcpy_dtoh(src, dst)?)
    }

    /// Uploads a weight matrix: `data` is `rows` GGUF rows of `cols` elements of `ty`.
    pub fn upload_matrix(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<DeviceMatrix, CudaError> {
        check_type(ty, "upload_matrix")?;
        let rb = row_bytes(ty, cols, "upload_matrix")?;
        ensure(rows > 0 && data.len() == rows * rb, "upload_matrix", || {
            format!(
                "{rows} rows of {cols} {ty} need {} bytes, got {}",
                rows * rb,
                data.len()
            )
        })?;
        Ok(DeviceMatrix {
            ty,
            rows,
            cols,
            row_bytes: rb,
            data: self.upload(data)?,
        })
    }

    /// Uploads an expert tensor `[n_expert, rows, cols]` of `ty`.
    pub fn upload_experts(
        &self,
        ty: GgmlType,
        n_expert: usize,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<DeviceExperts, CudaError> {
        check_type(ty, "upload_experts")?;
        let rb = row_bytes(ty, cols, "upload_experts")?;
        let want = n_expert * rows * rb;
        ensure(
            n_expert > 0 && rows > 0 && data.len() == want,
            "upload_experts",
            || {
                format!(
                    "{n_expert}×{rows} rows of {cols} {ty} need {want} bytes, got {}",
                    data.len()
                )
            },
        )?;
        Ok(DeviceExperts {
            ty,
            n_expert,
            rows,
            cols,
            row_bytes: rb,
            upload: None,
            data: self.upload(data)?,
        })
    }

    /// Uploads an expert tensor from per-expert parts: expert `i` of the result is `parts[i]`,
    /// `rows` rows of `cols` elements of `ty`, gathered from where it lies (the file mapping)
    /// by the CPU pool into pinned buffers that the copies drain as they fill
    /// (`Staging`). For op offload of the experts a batch routes to.
    pub fn upload_experts_from(
        &self,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        parts: &[&[u8]],
    ) -> Result<DeviceExperts, CudaError> {
        const OP: &str = "upload_experts_from";
        check_type(ty, OP)?;
        let rb = row_bytes(ty, cols, OP)?;
        let eb = rows * rb;
        ensure(
            !parts.is_empty() && rows > 0 && parts.iter().all(|p| p.len() == eb),
            OP,
            || {
                format!(
                    "{} parts of {rows} rows of {cols} {ty} ({eb} bytes each)",
                    parts.len()
                )
            },
        )?;
        // SAFETY: every byte is written by the staged copies below before any kernel reads it
        // (kernels on the compute stream wait for the `CopyUpload` recorded after them).
        let mut data =
            self.with_room(|| unsafe { self.copy_stream.alloc::<u8>(parts.len() * eb) })?;
        let mut staging = self.staging.lock().unwrap_or_else(PoisonError::into_inner);
        let ring = match staging.take() {
            Some(ring) => ring,
            None => Staging::new(&self.ctx)?,
        };
        staging
            .insert(ring)
            .upload(&self.copy_stream, parts, eb, &mut data)?;
        Ok(DeviceExperts {
            ty,
            n_expert: parts.len(),
            rows,
            cols,
            row_bytes: rb,
            upload: Some(CopyUpload::record(&self.copy_stream, &self.stream)?),
            data,
        })
    }
}
