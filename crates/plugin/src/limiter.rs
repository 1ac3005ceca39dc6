//! A store's resource budget: linear memory summed over *all* of the store's memories, plus counts of
//! instances, tables and memories.
//!
//! wasmtime's `StoreLimits` caps each linear memory on its own, so a component with several memories (one per
//! core module, or a multi-memory module) would get a multiple of the cap. [`Budget`] instead sees every
//! growth (memory creation included: wasmtime reports it as growing from 0 to the initial size) and
//! refuses the one that would take the store's total past the cap, with a typed [`MemoryCap`] trap. Stores
//! are per call, so memories never shrink or go away while the budget lives.

use thiserror::Error;
use wasmtime::ResourceLimiter;

/// The trap raised when a store's memories would grow past their cap.
#[derive(Debug, Error)]
#[error(
    "memory limit exceeded: the store's memories would take {wanted} bytes, more than the cap of {limit}"
)]
pub struct MemoryCap {
    /// The cap, in bytes over all memories.
    pub limit: usize,
    /// What the growth asked for in total.
    pub wanted: usize,
}

/// Instances, tables and memories a store may create: enough for a Rust wasip2 component (a handful of
/// core instances) and components composed of several modules.
const INSTANCES: usize = 32;
const TABLES: usize = 32;
const MEMORIES: usize = 4;

/// The limiter of one store.
#[derive(Debug)]
pub(super) struct Budget {
    limit: usize,
    /// Bytes of linear memory over all memories, as approved.
    used: usize,
    /// The last approved growth, taken back if it then fails.
    last: usize,
}

impl Budget {
    /// A budget of `limit` bytes of linear memory in total.
    pub(super) fn new(limit: usize) -> Self {
        Budget {
            limit,
            used: 0,
            last: 0,
        }
    }
}

impl ResourceLimiter for Budget {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let grow = desired.saturating_sub(current);
        let wanted = self.used.saturating_add(grow);
        if wanted > self.limit || maximum.is_some_and(|m| desired > m) {
            return Err(wasmtime::Error::new(MemoryCap {
                limit: self.limit,
                wanted,
            }));
        }
        self.used = wanted;
        self.last = grow;
        Ok(true)
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.used -= std::mem::take(&mut self.last);
        // As with the cap: a growth that fails is a trap, not a -1 the guest might ignore.
        Err(error.context("growing a linear memory failed"))
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if maximum.is_some_and(|m| desired > m) {
            wasmtime::bail!("a table would grow past its maximum to {desired} elements");
        }
        Ok(true)
    }

    fn instances(&self) -> usize {
        INSTANCES
    }

    fn tables(&self) -> usize {
        TABLES
    }

    fn memories(&self) -> usize {
        MEMORIES
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasm_encoder::{
        CodeSection, ExportKind, ExportSection, Function, FunctionSection, Instruction,
        MemorySection, MemoryType, Module, TypeSection, ValType,
    };
    use wasmtime::{Engine, Instance, Store};

    const PAGE: usize = 64 << 10;

    /// A core module with two memories of one page each and `grow0`/`grow1`, each `memory.grow` by one
    /// page on its memory.
    fn two_memories() -> Vec<u8> {
        let mut m = Module::new();
        let mut types = TypeSection::new();
        types.ty().function([], [ValType::I32]);
        m.section(&types);
        let mut funcs = FunctionSection::new();
        funcs.function(0).function(0);
        m.section(&funcs);
        let mut mems = MemorySection::new();
        for _ in 0..2 {
            mems.memory(MemoryType {
                minimum: 1,
                maximum: None,
                memory64: false,
                shared: false,
                page_size_log2: None,
            });
        }
        m.section(&mems);
        let mut exports = ExportSection::new();
        exports
            .export("grow0", ExportKind::Func, 0)
            .export("grow1", ExportKind::Func, 1);
        m.section(&exports);
        let mut code = CodeSection::new();
        for mem in 0..2 {
            let mut f = Function::new([]);
            f.instruction(&Instruction::I32Const(1))
                .instruction(&Instruction::MemoryGrow(mem))
                .instruction(&Instruction::End);
            code.function(&f);
        }
        m.section(&code);
        m.finish()
    }

    #[test]
    fn the_cap_is_the_sum_over_all_memories() {
        let engine = Engine::default();
        let module = wasmtime::Module::new(&engine, two_memories()).unwrap();
        // Three pages in all: the two initial pages and one growth fit, a second growth does not, even
        // though each memory alone (two pages) would be far below a per-memory cap of three.
        let mut store = Store::new(&engine, Budget::new(3 * PAGE));
        store.limiter(|b| b);
        let instance = Instance::new(&mut store, &module, &[]).unwrap();
        assert_eq!(store.data().used, 2 * PAGE);
        let grow = |store: &mut Store<Budget>, name: &str| {
            instance
                .get_typed_func::<(), i32>(&mut *store, name)
                .unwrap()
                .call(&mut *store, ())
        };
        assert_eq!(grow(&mut store, "grow0").unwrap(), 1, "old size in pages");
        let err = grow(&mut store, "grow1").unwrap_err();
        let cap = err.downcast_ref::<MemoryCap>().expect("a MemoryCap trap");
        assert_eq!((cap.limit, cap.wanted), (3 * PAGE, 4 * PAGE));
        assert_eq!(store.data().used, 3 * PAGE);
        // Two memories cannot be created under a one-page budget at all.
        let mut store = Store::new(&engine, Budget::new(PAGE));
        store.limiter(|b| b);
        let err = Instance::new(&mut store, &module, &[]).unwrap_err();
        assert!(err.downcast_ref::<MemoryCap>().is_some(), "{err:?}");
    }
}
