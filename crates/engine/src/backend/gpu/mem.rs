//! A GPU device's memory: allocations ([`DevMem`]), a [`Buf`](crate::backend::Buf)'s storage
//! ([`GpuBuf`], the [`DeviceMem`] a buffer holds on a GPU), the KV page pool's stores ([`PoolMem`]), and
//! the device's own staging ([`DevVec`]).

use super::launch::DevPtr;
use super::runtime::Queue;
use crate::backend::DeviceError;
use crate::backend::buf::DeviceMem;
use std::sync::Arc;

/// Device memory from a [`GpuRuntime`](super::GpuRuntime), released when dropped.
pub struct DevMem {
    pub(super) ptr: DevPtr,
    pub(super) bytes: usize,
    /// Host memory the device reads where it is (kept alive by the owner), not an allocation.
    pub(super) in_place: bool,
    pub(super) _owner: Box<dyn Send + Sync>,
}

impl std::fmt::Debug for DevMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevMem")
            .field("ptr", &self.ptr)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl DevMem {
    /// Memory at `ptr` of `bytes`, kept alive (and released) by `owner`.
    pub fn new(ptr: DevPtr, bytes: usize, owner: Box<dyn Send + Sync>) -> Self {
        DevMem {
            ptr,
            bytes,
            in_place: false,
            _owner: owner,
        }
    }

    /// Its address.
    pub fn ptr(&self) -> DevPtr {
        self.ptr
    }
}

/// A failure of the runtime inside an op: a bug or a lost device, reported as a panic with the driver's
/// words, which the engine turns into a failed request.
pub(super) fn fail(what: &str, e: DeviceError) -> ! {
    panic!("GPU {what}: {e}")
}

/// A [`Buf`](crate::backend::Buf)'s device memory, and the host copy that
/// [`Buf::read_back`](crate::backend::Buf::read_back) and [`Buf::edit`](crate::backend::Buf::edit) hand out.
#[derive(Debug)]
pub struct GpuBuf {
    pub(super) mem: DevMem,
    pub(super) len: usize,
    pub(super) host: Vec<f32>,
    pub(super) q: Arc<Queue>,
}

impl GpuBuf {
    /// Its first `n` values, after the queued work (see [`Buf::read_back`](crate::backend::Buf::read_back)).
    fn download_host(&mut self, n: usize) -> &mut [f32] {
        self.host.resize(self.len, 0.0);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.host[..n]);
        if let Err(e) = self.q.download(self.mem.ptr(), bytes) {
            fail("read-back", e);
        }
        &mut self.host[..n]
    }
}

impl DeviceMem for GpuBuf {
    fn len(&self) -> usize {
        self.len
    }

    fn ptr(&self) -> DevPtr {
        self.mem.ptr()
    }

    fn read_back(&mut self, n: usize) -> &mut [f32] {
        self.download_host(n)
    }

    fn host(&self) -> &[f32] {
        &self.host[..self.len]
    }

    fn host_mut(&mut self) -> &mut [f32] {
        &mut self.host[..self.len]
    }

    /// Queues the upload of the host copy (the whole buffer).
    fn write_back(&mut self) {
        if let Err(e) = self
            .q
            .upload(self.mem.ptr(), bytemuck::cast_slice(&self.host[..self.len]))
        {
            fail("write-back", e);
        }
    }

    fn upload(&mut self, at: usize, data: &[f32]) {
        assert!(at + data.len() <= self.len, "an upload past the end");
        let dst = self.mem.ptr().offset(4 * at);
        if let Err(e) = self.q.upload(dst, bytemuck::cast_slice(data)) {
            fail("upload", e);
        }
    }

    fn download(&self, at: usize, out: &mut [f32]) {
        assert!(at + out.len() <= self.len, "a download past the end");
        let src = self.mem.ptr().offset(4 * at);
        if let Err(e) = self.q.download(src, bytemuck::cast_slice_mut(out)) {
            fail("download", e);
        }
    }

    fn copy_in(&mut self, at: usize, src: DevPtr, n: usize) {
        assert!(at + n <= self.len, "a copy past the end");
        if n == 0 {
            return;
        }
        if let Err(e) = self.q.copy(self.mem.ptr().offset(4 * at), src, 4 * n) {
            fail("device copy", e);
        }
    }

    fn duplicate(&self) -> Box<dyn DeviceMem> {
        let copied = self.q.alloc(4 * self.len).and_then(|mem| {
            if self.len > 0 {
                self.q.copy(mem.ptr(), self.mem.ptr(), 4 * self.len)?;
            }
            Ok(mem)
        });
        match copied {
            Ok(mem) => Box::new(GpuBuf {
                mem,
                len: self.len,
                host: Vec::new(),
                q: Arc::clone(&self.q),
            }),
            Err(e) => fail("device copy", e),
        }
    }
}

impl Drop for GpuBuf {
    fn drop(&mut self) {
        // A queued kernel may still use the memory.
        let _ = self.q.wait();
    }
}

/// A KV page pool's store in device memory (see [`PageDevice`](crate::backend::pages::PageDevice)):
/// released once the work queued before its release is done.
#[derive(Debug)]
pub struct PoolMem {
    /// Freed after the wait below.
    pub(super) _mem: DevMem,
    pub(super) q: Arc<Queue>,
}

impl Drop for PoolMem {
    fn drop(&mut self) {
        // A queued kernel may still use the memory.
        let _ = self.q.wait();
    }
}

/// Device staging that only grows, and remembers what it was last given (so identical host data is not
/// uploaded again) and which segment of the [`Queue`] it was last handed to.
#[derive(Debug, Default)]
pub struct DevVec {
    pub(super) mem: Option<DevMem>,
    pub(super) last: Vec<u8>,
    pub(super) used: Option<u64>,
}

impl DevVec {
    /// At least `bytes` of device memory; growing replaces it once the work that may use it is done.
    pub(super) fn reserve(&mut self, q: &Queue, bytes: usize) -> Result<DevPtr, DeviceError> {
        match &self.mem {
            Some(m) if m.bytes >= bytes => Ok(m.ptr()),
            _ => {
                q.wait()?;
                let m = q.alloc(bytes.next_power_of_two().max(256))?;
                let p = m.ptr();
                self.mem = Some(m);
                self.last.clear();
                Ok(p)
            }
        }
    }

    /// `data` in device memory, for an op of the current segment: uploaded unless the staging holds
    /// exactly it already (ending the segment first if one of its ops was handed the old contents).
    pub(super) fn put(&mut self, q: &Queue, data: &[u8]) -> Result<DevPtr, DeviceError> {
        let mut r = q.rec();
        if let Some(m) = &self.mem
            && self.last == data
        {
            self.used = Some(r.id);
            return Ok(m.ptr());
        }
        if self.used == Some(r.id) {
            q.flush_locked(&mut r)?;
        }
        drop(r);
        let p = self.reserve(q, data.len())?;
        q.rt.upload(p, data)?;
        self.last.clear();
        self.last.extend_from_slice(data);
        self.used = Some(q.rec().id);
        Ok(p)
    }

    /// [`DevVec::put`] for several stagings at once, with one lock of the queue for all that need no
    /// upload (the common case: a step's metadata, the same for every layer): `Some(data)` as `put`,
    /// `None` what the staging holds already, handed to the current segment.
    pub(super) fn put_all<const N: usize>(
        q: &Queue,
        mut items: [(&mut DevVec, Option<&[u8]>); N],
    ) -> Result<[DevPtr; N], DeviceError> {
        let mut out = [DevPtr(0); N];
        let mut kept = [false; N];
        for (i, (v, data)) in items.iter_mut().enumerate() {
            match (&v.mem, *data) {
                (Some(m), None) => (out[i], kept[i]) = (m.ptr(), true),
                (Some(m), Some(d)) if v.last == d => (out[i], kept[i]) = (m.ptr(), true),
                (_, Some(d)) => out[i] = v.put(q, d)?,
                (None, None) => (out[i], kept[i]) = (v.reserve(q, 0)?, true),
            }
        }
        // Those kept are read by an op of the segment now current (after any flush an upload made).
        let id = q.rec().id;
        for ((v, _), _) in items.iter_mut().zip(kept).filter(|(_, k)| *k) {
            v.used = Some(id);
        }
        Ok(out)
    }

    /// Device scratch of `bytes` that an op of the current segment writes.
    pub(super) fn scratch(&mut self, q: &Queue, bytes: usize) -> Result<DevPtr, DeviceError> {
        let p = self.reserve(q, bytes)?;
        self.last.clear();
        self.used = Some(q.rec().id);
        Ok(p)
    }
}
