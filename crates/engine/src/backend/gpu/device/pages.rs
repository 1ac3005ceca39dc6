//! A KV page pool's stores in the GPU's memory ([`GpuPages`]): plain device allocations, copied by kernels
//! queued in order with the passes that read and write them.

use super::GpuDevice;
use crate::backend::DeviceError;
use crate::backend::gpu::launch::{self, DevPtr};
use crate::backend::gpu::mem::{DevVec, PoolMem, fail};
use crate::backend::gpu::runtime::Queue;
use crate::backend::pages::{DeviceRegion, PageDevice, PageId, PagePool, RowMove};
use std::sync::{Arc, Mutex};

/// The [`PageDevice`] of a GPU: its queue, and the staging of the row moves.
#[derive(Debug)]
pub(super) struct GpuPages {
    q: Arc<Queue>,
    moves: Mutex<DevVec>,
}

impl GpuPages {
    pub(super) fn new(q: Arc<Queue>) -> Self {
        GpuPages {
            q,
            moves: Mutex::default(),
        }
    }
}

impl PageDevice for GpuPages {
    fn alloc(&self, bytes: usize) -> Result<DeviceRegion, DeviceError> {
        let mem = self.q.alloc(bytes)?;
        Ok(DeviceRegion {
            addr: mem.ptr().0,
            bytes,
            _owner: Box::new(PoolMem {
                _mem: mem,
                q: Arc::clone(&self.q),
            }),
        })
    }

    fn copy_page(&self, pool: &PagePool, src: PageId, dst: PageId, n: usize) {
        let store = GpuDevice::store(pool);
        if let Err(e) = launch::copy_page(&*self.q, &store, src, dst, n) {
            fail("KV page copy", e);
        }
    }

    fn move_rows(&self, pool: &PagePool, moves: &[RowMove]) {
        if moves.is_empty() {
            return;
        }
        let store = GpuDevice::store(pool);
        let mut staged = self
            .moves
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let moved = staged
            .put(&self.q, bytemuck::cast_slice(moves))
            .and_then(|p| launch::move_rows(&*self.q, &store, p, moves.len()));
        if let Err(e) = moved {
            fail("KV row moves", e);
        }
    }

    fn read(&self, addr: u64, out: &mut [u8]) {
        if let Err(e) = self.q.download(DevPtr(addr), out) {
            fail("KV read-back", e);
        }
    }

    fn write(&self, addr: u64, data: &[u8]) {
        if let Err(e) = self.q.upload(DevPtr(addr), data) {
            fail("KV upload", e);
        }
    }
}
