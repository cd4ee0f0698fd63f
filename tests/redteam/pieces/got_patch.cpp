
#include <elf.h>
#include <link.h>
#include <sys/mman.h>
#include <cstdint>
#include <cstring>
static int patch_got(const char* symbol, void* replacement) {
  int patched = 0;
  for (link_map* m = _r_debug.r_map; m != nullptr; m = m->l_next) {
    if (m->l_ld == nullptr) continue;
    ElfW(Sym)* symtab = nullptr; const char* strtab = nullptr; ElfW(Rela)* rel = nullptr; size_t size = 0;
    for (ElfW(Dyn)* d = m->l_ld; d->d_tag != DT_NULL; ++d) {
      // The loader relocates these in place, except in objects it did not load itself (the vDSO).
      uintptr_t p = d->d_un.d_ptr < m->l_addr ? m->l_addr + d->d_un.d_ptr : d->d_un.d_ptr;
      if (d->d_tag == DT_SYMTAB) symtab = reinterpret_cast<ElfW(Sym)*>(p);
      else if (d->d_tag == DT_STRTAB) strtab = reinterpret_cast<const char*>(p);
      else if (d->d_tag == DT_JMPREL) rel = reinterpret_cast<ElfW(Rela)*>(p);
      else if (d->d_tag == DT_PLTRELSZ) size = d->d_un.d_val;
    }
    if (symtab == nullptr || strtab == nullptr || rel == nullptr) continue;
    for (size_t i = 0; i < size / sizeof(ElfW(Rela)); ++i) {
      if (std::strcmp(strtab + symtab[ELF64_R_SYM(rel[i].r_info)].st_name, symbol) != 0) continue;
      void** slot = reinterpret_cast<void**>(m->l_addr + rel[i].r_offset);
      uintptr_t page = reinterpret_cast<uintptr_t>(slot) & ~static_cast<uintptr_t>(4095);
      pkey_mprotect(reinterpret_cast<void*>(page), 4096, PROT_READ | PROT_WRITE, -1);
      *slot = replacement;
      ++patched;
    }
  }
  return patched;
}
