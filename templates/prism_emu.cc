// prism_emu.cc: the definitions of the emulation's runtime, declared in prism_emu.h. Compiled once per set of
// compiler flags (plain, each sanitizer's) into an object that every emulation build with those flags links
// (backend/emulate.py), so that a build compiles only its kernels and their harness. It must be compiled with the
// flags of the kernels it is linked with: the sanitizers must see the runtime's own accesses to the kernels'
// memory (cp.async's and TMA's copies, a collective's exchange) as they see the kernels'.
#include "prism_emu.h"

#include <sys/mman.h>
#include <unistd.h>
#if defined(__linux__)
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#endif

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace prism {
namespace emu {

Runtime& rt() {
    static Runtime r;
    return r;
}

PRISM_UNSEEN Thread* self() { return rt().current; }

PRISM_UNSEEN prism_dim3 block_idx() { return rt().current->block->idx; }

PRISM_UNSEEN prism_dim3 thread_idx() { return rt().current->idx; }

// -- reports ----------------------------------------------------------------------------------------------------
Text who(const Thread* t) {
    Text text;
    std::snprintf(text.s, sizeof text.s, "block (%u,%u,%u) thread %d (warp %d, lane %d)", t->block->idx.x,
                  t->block->idx.y, t->block->idx.z, t->linear, t->linear / kWarp, t->linear % kWarp);
    return text;
}

Text where(const Site& s) {
    Text text;
    std::snprintf(text.s, sizeof text.s, "%s:%d", s.file ? s.file : "?", s.line);
    return text;
}

// Threads given as ranges: "threads 0-31, 64-95".
static std::string ranges(const std::vector<int>& ids) {
    std::string out;
    for (size_t i = 0; i < ids.size();) {
        size_t j = i;
        while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
        out += (out.empty() ? "" : ", ") + std::to_string(ids[i]) + (j > i ? "-" + std::to_string(ids[j]) : "");
        i = j + 1;
    }
    return out;
}

// The process ends with `code` at once. Not through ThreadSanitizer's _exit, which would take the ignores a finding is
// raised inside (`Quiet`) for an error of its own and end with its exit status, the finding's words lost.
[[noreturn]] static void exit_now(int code) {
#if defined(__linux__)
    syscall(SYS_exit_group, code);
#endif
    _exit(code);
}

[[noreturn]] void fail(const std::vector<Site>& at, const char* fmt, ...) {
    Quiet quiet;
    char text[2048];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    std::fprintf(stderr, "prism-emulation: kernel %s: %s\n", rt().launch ? rt().launch->kernel : "?", text);
    for (const Site& s : at)
        if (s.file) std::fprintf(stderr, "prism-emulation-at: %s\n", where(s).c_str());
    std::fflush(stderr);
    exit_now(kExitFinding);
}

#if defined(PRISM_TSAN) || defined(PRISM_ASAN)
static void on_death() {  // a sanitizer stops the run: say which emulated thread was running
    if (Thread* t = self())
        std::fprintf(stderr, "prism-emulation-thread: kernel %s, %s\n", rt().launch->kernel, who(t).c_str());
}
#endif

// -- fibers ---------------------------------------------------------------------------------------------------------
#if defined(__x86_64__) && defined(__LP64__) && defined(__ELF__) && !defined(PRISM_EMU_UCONTEXT)
// switch_context(from, to): pushes the callee-saved registers and the SSE and x87 control words (System V AMD64: all
// a called function must preserve), saves the stack pointer in from->sp, and pops to's, returning where to was
// switched away (or, a fiber's first time, into its entry: `start_context`). No system call. Each `ret` goes where
// no call came from, which a CET shadow stack would stop: the emulation is built with -fcf-protection=none
// (backend/emulate.py), so that the kernel never turns one on for it.
extern "C" void prism_emu_switch(void** from, void* to);
asm(R"(
    .text
    .p2align 4
    .globl prism_emu_switch
    .hidden prism_emu_switch
    .type prism_emu_switch, @function
prism_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size prism_emu_switch, .-prism_emu_switch
)");

// Inlined into `switch_to`, which ThreadSanitizer does not instrument: an instrumented call here would push its frame
// onto the shadow stack of the fiber switched to, never popped at a fiber's first entry.
__attribute__((always_inline)) static inline void switch_context(Context* from, Context* to) {
    prism_emu_switch(&from->sp, to->sp);
}

// A fiber's stack made to enter `fn` at its first switch, as if called (the stack 16-byte aligned before the call,
// a null return address: fn never returns), with the control words the runtime runs with.
static void start_context(Context* ctx, char* stack, size_t bytes, void (*fn)()) {
    auto* top = reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t(15));
    uint64_t* sp = top - 9;  // the control words, six registers, then fn as the return address
    top[-1] = 0;
    top[-2] = reinterpret_cast<uint64_t>(fn);
    for (int i = 1; i < 7; ++i) sp[i] = 0;
    uint32_t mxcsr;
    uint16_t fpucw;
    asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(mxcsr), "=m"(fpucw));
    std::memcpy(sp, &mxcsr, 4);
    std::memcpy(reinterpret_cast<char*>(sp) + 4, &fpucw, 2);
    ctx->sp = sp;
}
#else
__attribute__((always_inline)) static inline void switch_context(Context* from, Context* to) { swapcontext(from, to); }

static void start_context(Context* ctx, char* stack, size_t bytes, void (*fn)()) {
    getcontext(ctx);
    ctx->uc_stack.ss_sp = stack;
    ctx->uc_stack.ss_size = bytes;
    ctx->uc_link = nullptr;
    makecontext(ctx, fn, 0);
}
#endif

PRISM_UNSEEN static void switch_to(Thread* from, Thread* to) {  // from/to null: the scheduler (the main context)
    Runtime& r = rt();
    r.current = to;
#if defined(PRISM_TSAN)
    __tsan_switch_to_fiber(to ? to->fiber : r.main_fiber, __tsan_switch_to_fiber_no_sync);
#endif
#if defined(PRISM_ASAN)
    void** save = from ? (from->state == State::kDone ? nullptr : &from->fake_stack) : nullptr;
    void* main_save = nullptr;
    __sanitizer_start_switch_fiber(from ? save : &main_save, to ? to->stack : r.main_stack,
                                   to ? r.stack_bytes : r.main_stack_size);
#endif
    switch_context(from ? &from->ctx : &r.main, to ? &to->ctx : &r.main);
#if defined(PRISM_ASAN)
    __sanitizer_finish_switch_fiber(from ? from->fake_stack : main_save, nullptr, nullptr);
#endif
}

static void yield() { switch_to(self(), nullptr); }

static void finish_checks(Thread* t) {
    const Warp& w = t->block->warps[t->linear / kWarp];
    if (!w.wgmma.empty())
        fail({w.wgmma.front().site}, "%s ends with %zu wgmma in flight, never waited for (issued at %s)", who(t).c_str(),
             w.wgmma.size(), where(w.wgmma.front().site).c_str());
    if (!t->copies.empty())
        fail({t->copies.front().site}, "%s ends with %zu cp.async cop%s never waited for (issued at %s)",
             who(t).c_str(), t->copies.size(), t->copies.size() == 1 ? "y" : "ies",
             where(t->copies.front().site).c_str());
    if (!t->landings.empty())
        fail({t->landings.front().site}, "%s ends with a cp.async.mbarrier.arrive no thread waited for (at %s)",
             who(t).c_str(), where(t->landings.front().site).c_str());
}

static void entry() {
    Runtime& r = rt();
#if defined(PRISM_ASAN)
    __sanitizer_finish_switch_fiber(nullptr, &r.main_stack, &r.main_stack_size);
#endif
    Thread* t = self();
    acquire(&r.launch_sync);
    r.launch->fn(r.launch->args);
    PRISM_BANKS_DO(sync(t, true));
    {
        Quiet quiet;
        finish_checks(t);
        t->state = State::kDone;
    }
    release(&t->block->exit_sync);
    release(&r.done_sync);
    switch_to(t, nullptr);
    std::abort();  // a finished fiber is never resumed
}

static Thread* fiber(size_t slot) {
    Runtime& r = rt();
    while (r.pool.size() <= slot) {
        Thread* t = new Thread;
        void* mem = mmap(nullptr, r.stack_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                         -1, 0);
        if (mem == MAP_FAILED) {
            std::fprintf(stderr, "prism-emulation: cannot map a stack for emulated thread %zu\n", slot);
            exit_now(kExitFinding);
        }
        t->stack = static_cast<char*>(mem);
#if defined(PRISM_TSAN)
        t->fiber = __tsan_create_fiber(0);
#endif
        r.pool.push_back(t);
    }
    return r.pool[slot];
}

// -- shared memory --------------------------------------------------------------------------------------------------
void declare_shared(size_t bytes, const char* file, int line) {
    Quiet quiet;
    if (bytes > rt().launch->smem)
        fail({{file, line}}, "declares %zu bytes of shared memory; the launch gives %zu", bytes, rt().launch->smem);
}

void* shared(size_t offset, size_t bytes, int first, int last, const char* file, int line) {
    Quiet quiet;
    Block* b = self()->block;
    if (offset + bytes > rt().launch->smem)
        fail({{file, line}}, "shared buffer at offset %zu (%zu bytes) ends past the launch's %zu bytes", offset, bytes,
             rt().launch->smem);
    if (first < 0 || first > last || last > kLastPhase)
        fail({{file, line}}, "shared buffer at offset %zu: phases %d..%d are not within 0..%d", offset, first, last,
             kLastPhase);
    for (const Buffer& have : b->buffers) {
        if (have.offset == offset && have.bytes == bytes && have.first == first && have.last == last) return have.mem;
        if (offset < have.offset + have.bytes && have.offset < offset + bytes && first <= have.last && have.first <= last)
            fail({{file, line}}, "shared buffers overlap while both are in use: [%zu, %zu) in phases %d..%d and [%zu, %zu) "
                 "in %d..%d", offset, offset + bytes, first, last, have.offset, have.offset + have.bytes, have.first,
                 have.last);
    }
    // The GPU's dynamic shared memory starts on a 1024-byte boundary: the buffer sits at the same place modulo
    // 1024, so address bits that select a swizzle (wgmma's operands) select the same one here.
    const size_t lead = offset % 1024, total = lead + (bytes + 127) / 128 * 128;
    void* got = nullptr;
    if (posix_memalign(&got, 1024, total) != 0) fail({{file, line}}, "out of memory for a %zu-byte shared buffer", bytes);
    unsigned char* base = static_cast<unsigned char*>(got);
    unsigned char* mem = base + lead;
    std::memset(mem, 0xFF, bytes);  // the NaN pattern of every float type
#if defined(PRISM_ASAN)
    __asan_poison_memory_region(base, lead);
    __asan_poison_memory_region(mem + (first > b->phase ? 0 : bytes), total - lead - (first > b->phase ? 0 : bytes));
#endif
    b->buffers.push_back({offset, bytes, mem, base, first, last, std::vector<unsigned char>(bytes, 0xFF)});
    return mem;
}

void phase(int p, const char* file, int line) {
    Quiet quiet;
    Block* b = self()->block;
    if (p <= b->phase) return;
    if (p > kLastPhase) fail({{file, line}}, "phase %d: a launch has phases 0..%d", p, kLastPhase);
    const int was = b->phase;
    b->phase = p;
    for (Buffer& have : b->buffers) {
        const bool before = have.first <= was && was <= have.last, now = have.first <= p && p <= have.last;
        if (before && now) continue;
#if defined(PRISM_ASAN)
        __asan_unpoison_memory_region(have.mem, have.bytes);
#endif
        std::memset(have.mem, 0xFF, have.bytes);
        std::fill(have.seen.begin(), have.seen.end(), 0xFF);
#if defined(PRISM_ASAN)
        if (!now) __asan_poison_memory_region(have.mem, have.bytes);
#endif
    }
}

const Buffer* buffer_of(const Block* b, const void* p, size_t bytes) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    for (const Buffer& have : b->buffers)
        if (c >= have.mem && c + bytes <= have.mem + have.bytes) return &have;
    return nullptr;
}

bool in_shared(const Block* b, const void* p, size_t bytes) { return buffer_of(b, p, bytes) != nullptr; }

void fence_proxy_async() {
    Quiet quiet;
    Block* b = self()->block;
    for (Buffer& have : b->buffers)
        if (have.first <= b->phase && b->phase <= have.last) std::memcpy(have.seen.data(), have.mem, have.bytes);
}

// -- barriers and warp collectives ----------------------------------------------------------------------------------
void barrier(const char* file, int line) {
    Thread* t = self();
    PRISM_BANKS_DO(sync(t, false));
    Block* b;
    char* sync;
    bool wait;
    {
        Quiet quiet;
        b = t->block;
        sync = &b->sync[b->generation % 2];
    }
    release(sync);
    {
        Quiet quiet;
        Site here{file, line, "__syncthreads()"};
        if (b->at_barrier == 0) {
            b->barrier = here;
        } else if (b->barrier.line != line || std::strcmp(b->barrier.file, file) != 0) {
            fail({b->barrier, here}, "divergent barrier in block (%u,%u,%u): threads wait at %s, thread %d reaches %s",
                 b->idx.x, b->idx.y, b->idx.z, where(b->barrier).c_str(), t->linear, where(here).c_str());
        }
        t->state = State::kBarrier;
        t->site = here;
        if (++b->at_barrier == static_cast<int>(b->threads.size())) {
            b->at_barrier = 0;
            ++b->generation;
            for (Thread* o : b->threads) o->state = State::kReady;
        }
        wait = t->state != State::kReady;
    }
    if (wait) yield();
    acquire(sync);
}

bool barrier_or(bool vote, const char* file, int line) {
    Block* b;
    unsigned generation;
    {
        Quiet quiet;
        b = self()->block;
        generation = b->generation;
        if (b->at_barrier == 0) b->vote[generation % 2] = false;  // the first to arrive
        b->vote[generation % 2] = b->vote[generation % 2] || vote;
    }
    barrier(file, line);
    Quiet quiet;
    return b->vote[generation % 2];  // not reset before every thread has read it: the next generation uses the other
}

void collective(const char* what, unsigned mask, const char* file, int line, const void* in, void* out,
                void (*op)(const void* const*, void* const*)) {
    Thread* t = self();
    PRISM_BANKS_DO(sync(t, false));
    Warp* w;
    char* sync;
    bool wait;
    {
        Quiet quiet;
        Block* b = t->block;
        Site here{file, line, what};
        const int lane = t->linear % kWarp, first = t->linear - lane;
        if (first + kWarp > static_cast<int>(b->threads.size()))
            fail({here}, "%s needs a whole warp, but warp %d of the %zu-thread block has %zu lanes", what,
                 t->linear / kWarp, b->threads.size(), b->threads.size() - first);
        if (mask != 0xFFFFFFFFu)
            fail({here}, "%s with lane mask 0x%08x in %s: the generated code uses full warps only", what, mask,
                 who(t).c_str());
        w = &b->warps[t->linear / kWarp];
        if (w->arrived == 0) {
            w->site = here;
            w->op = op;
        } else if (w->site.line != line || std::strcmp(w->site.file, file) != 0 || w->op != op) {
            std::vector<int> lanes;
            for (int l = 0; l < kWarp; ++l)
                if (b->threads[first + l]->state == State::kWarp) lanes.push_back(l);
            fail({w->site, here}, "divergent warp collective in block (%u,%u,%u) warp %d: lanes %s wait at %s (%s), "
                 "lane %d reaches %s (%s)", b->idx.x, b->idx.y, b->idx.z, t->linear / kWarp, ranges(lanes).c_str(),
                 where(w->site).c_str(), w->site.what, lane, where(here).c_str(), what);
        }
        w->in[lane] = in;
        w->out[lane] = out;
        t->state = State::kWarp;
        t->site = here;
        sync = &w->sync[w->generation % 2];
        wait = ++w->arrived < kWarp;
    }
    // The lane that arrives last performs the collective's memory accesses for the whole warp, so the lanes are
    // ordered around it (as by __syncwarp): a race between lanes of one warp across a collective goes unseen.
    release(sync);
    if (!wait) {
        acquire(sync);
        {
            Quiet quiet;  // lanes' registers pass between fibers unseen; the op shows its memory accesses (Visible)
            rt().op_site = w->site;
            PRISM_BANKS_DO(quiet(true));
            w->op(w->in, w->out);
            PRISM_BANKS_DO(quiet(false));
            w->arrived = 0;
            ++w->generation;
            const int first = t->linear - t->linear % kWarp;
            for (int l = 0; l < kWarp; ++l) t->block->threads[first + l]->state = State::kReady;
        }
        release(sync);
    } else {
        yield();
    }
    acquire(sync);
}

// -- cp.async: copies queued per thread, completed by the wait that covers their group -----------------------------
void cp_async(void* dst, const void* src, int size, const char* file, int line) {
    Thread* t = self();
    Copy c;
    {
        Quiet quiet;
        const Site here{file, line, "cp.async"};
        if (reinterpret_cast<uintptr_t>(dst) % size || reinterpret_cast<uintptr_t>(src) % size)
            fail({here}, "cp.async of %d bytes from %p to %p in %s: both addresses must be %d-byte aligned", size, src,
                 dst, who(t).c_str(), size);
        if (!in_shared(t->block, dst, size))
            fail({here}, "cp.async in %s writes %p, outside the block's shared buffers", who(t).c_str(), dst);
        if (in_shared(t->block, src, size))
            fail({here}, "cp.async in %s reads shared memory at %p; its source is global memory", who(t).c_str(), src);
        c.seq = t->issued++;
        PRISM_BANKS_DO(copy(dst, size, file, line));
        c.dst = static_cast<unsigned char*>(dst);
        c.size = size;
        c.site = here;
    }
    if (src)
        std::memcpy(c.data, src, size);  // the source is read when the copy is issued
    else
        std::memset(c.data, 0, size);  // a guarded copy past the tensor's end (`cp_async_or_zero`): zeros, nothing read
    std::memset(dst, 0xFF, size);  // and the destination is undefined until the wait
    Quiet quiet;
    t->copies.push_back(c);
}

void cp_async_commit() {
    Quiet quiet;
    Thread* t = self();
    size_t grouped = 0;
    for (size_t g : t->groups) grouped += g;
    t->groups.push_back(t->copies.size() - grouped);
}

static void settle(Thread* t);

void cp_async_wait(int n) {
    Thread* t = self();
    while (t->groups.size() > static_cast<size_t>(n)) {
        size_t count;
        {
            Quiet quiet;
            count = t->groups.front();
        }
        for (size_t i = 0; i < count; ++i) std::memcpy(t->copies[i].dst, t->copies[i].data, t->copies[i].size);
        Quiet quiet;
        t->copies.erase(t->copies.begin(), t->copies.begin() + count);
        t->groups.erase(t->groups.begin());
    }
    settle(t);
}

// -- mbarriers: arrivals counted per phase; cp.async.mbarrier.arrive made when the thread's copies complete ----
static Mbarrier& find_mbarrier(Block* b, const void* bar, const Site& here) {
    for (auto& [at, m] : b->mbarriers)
        if (at == bar) return m;
    fail({here}, "%s at %p in block (%u,%u,%u): no mbarrier was initialised there", here.what, bar, b->idx.x, b->idx.y,
         b->idx.z);
}

// A phase completes once its arrivals are all made and the bytes it expects from TMA copies all delivered.
static void complete_if_due(Block* b, Mbarrier& m, const void* bar) {
    if (m.pending > 0 || m.tx != 0) return;
    ++m.phase;
    m.pending = m.count;
    for (Thread* o : b->threads)
        if (o->state == State::kMbarrier && o->waits_on == bar) o->state = State::kReady;  // each looks again
}

static bool land_bulks(Block* b, const void* bar);

// A phase that has all its arrivals and waits only for the bytes of TMA copies in flight completes when they land,
// whether or not a thread waits for it: they land before anything of the next phase (an arrival, expected bytes).
static void settle_phase(Block* b, const void* bar, const Site& here) {
    bool landing;
    {
        Quiet quiet;
        landing = find_mbarrier(b, bar, here).pending == 0;
    }
    if (landing) land_bulks(b, bar);
}

// One arrival at the mbarrier at `bar`, in the phase it is in.
static void arrive_at(Block* b, const void* bar, const Site& here) {
    char* sync;
    settle_phase(b, bar, here);
    {
        Quiet quiet;
        Mbarrier& m = find_mbarrier(b, bar, here);
        sync = &m.sync[m.phase % 2];
    }
    release(sync);
    Quiet quiet;
    Mbarrier& m = find_mbarrier(b, bar, here);
    if (m.pending == 0)
        fail({m.init, here}, "%s at %p: the phase already has its %d arrivals and waits for %ld bytes no TMA copy in "
             "flight brings: an mbarrier.expect_tx too large, or one arrival too many", here.what, bar, m.count, m.tx);
    --m.pending;
    complete_if_due(b, m, bar);
}

// Thread t's copies issued before its k-th pending cp.async.mbarrier.arrive are complete (performed now, by
// whichever thread needs them), and its arrivals up to that one are made.
static void land(Thread* t, size_t k) {
    std::vector<Copy> done;
    std::vector<Thread::Landing> made;
    {
        Quiet quiet;
        const size_t upto = t->landings[k].seq;
        size_t n = 0;
        while (n < t->copies.size() && t->copies[n].seq < upto) ++n;
        done.assign(t->copies.begin(), t->copies.begin() + n);
        t->copies.erase(t->copies.begin(), t->copies.begin() + n);
        for (size_t left = n; left > 0 && !t->groups.empty();) {  // the groups those copies were in shrink
            const size_t take = std::min(left, t->groups.front());
            t->groups.front() -= take, left -= take;
            if (t->groups.front() == 0) t->groups.erase(t->groups.begin());
        }
        made.assign(t->landings.begin(), t->landings.begin() + k + 1);
        t->landings.erase(t->landings.begin(), t->landings.begin() + k + 1);
    }
    acquire(&t->landing_sync);  // after what t did before it issued them
    for (const Copy& c : done) std::memcpy(c.dst, c.data, c.size);
    for (const Thread::Landing& l : made) arrive_at(t->block, l.bar, l.site);
}

// The arrivals of thread t whose copies have all completed (by its cp.async.wait_group) are made.
static void settle(Thread* t) {
    size_t k = 0;
    {
        Quiet quiet;
        const size_t next = t->copies.empty() ? t->issued : t->copies.front().seq;
        while (k < t->landings.size() && t->landings[k].seq <= next) ++k;
    }
    if (k > 0) land(t, k - 1);
}

void mbarrier_init(void* bar, int count, const char* file, int line) {
    Quiet quiet;
    Block* b = self()->block;
    const Site here{file, line, "mbarrier.init"};
    if (!in_shared(b, bar, 8) || reinterpret_cast<uintptr_t>(bar) % 8)
        fail({here}, "mbarrier.init at %p: an mbarrier is 8 aligned bytes of shared memory", bar);
    if (count < 1) fail({here}, "mbarrier.init at %p with %d arrivals: at least one", bar, count);
    for (auto& [at, m] : b->mbarriers)
        if (at == bar) fail({m.init, here}, "mbarrier at %p initialised twice", bar);
    Mbarrier m;
    m.count = m.pending = count;
    m.init = here;
    m.init_by = self();
    b->mbarriers.emplace_back(bar, m);
}

void mbarrier_init_fence() {
    Quiet quiet;
    Thread* t = self();
    for (auto& [at, m] : t->block->mbarriers)
        if (m.init_by == t) m.fenced = true;
}

void mbarrier_expect_tx(void* bar, unsigned bytes, const char* file, int line) {
    Block* b = self()->block;
    const Site here{file, line, "mbarrier.arrive.expect_tx"};
    settle_phase(b, bar, here);
    {
        Quiet quiet;
        Mbarrier& m = find_mbarrier(b, bar, here);
        m.tx += bytes;
        if (bytes == 0 || m.tx >= (1L << 20))
            fail({here}, "mbarrier.arrive.expect_tx of %u bytes at %p: a phase expects 1 to 2^20 - 1 bytes (%ld now)",
                 bytes, bar, m.tx);
    }
    arrive_at(b, bar, here);
}

void mbarrier_arrive(void* bar, const char* file, int line) {
    arrive_at(self()->block, bar, {file, line, "mbarrier.arrive"});
}

void cp_async_mbarrier_arrive(void* bar, const char* file, int line) {
    Thread* t = self();
    {
        Quiet quiet;
        const Site here{file, line, "cp.async.mbarrier.arrive"};
        find_mbarrier(t->block, bar, here);
        t->landings.push_back({t->issued, bar, here});
    }
    release(&t->landing_sync);
    settle(t);  // with no copy outstanding, at once
}

// -- TMA: a box of a tensor copied into shared memory by one instruction, completing bytes of an mbarrier ----------
static Buffer* shared_buffer(Block* b, const void* p, size_t bytes) {
    return const_cast<Buffer*>(buffer_of(b, p, bytes));
}

void tma_load(void* dst, const TensorMap& map, void* bar, const int* at, int n, const char* file, int line) {
    Thread* t = self();
    Block* b = t->block;
    const Site here{file, line, "cp.async.bulk.tensor"};
    Bulk* bulk = new Bulk;
    size_t bytes = map.elem;
    {
        Quiet quiet;
        if (n != map.rank || n < 1 || n > 5)
            fail({here}, "a TMA copy with %d coordinates from a tensor map of rank %d", n, map.rank);
        for (int i = 0; i < n; ++i) bytes *= map.box[i];
        Mbarrier& m = find_mbarrier(b, bar, here);
        if (!m.fenced)
            fail({m.init, here}, "a TMA copy in %s completes bytes of the mbarrier at %p, whose initialisation was not "
                 "made visible to the async proxy (fence.mbarrier_init after mbarrier.init)", who(t).c_str(), bar);
        if (!in_shared(b, dst, bytes))
            fail({here}, "a TMA copy in %s writes %zu bytes at %p, outside the block's shared buffers", who(t).c_str(),
                 bytes, dst);
        if (reinterpret_cast<uintptr_t>(dst) % (map.swizzle ? 1024 : 128))
            fail({here}, "a TMA copy in %s writes at %p: the destination of a %s box is %d-byte aligned", who(t).c_str(),
                 dst, map.swizzle ? "swizzled" : "plain", map.swizzle ? 1024 : 128);
        for (int i = 0; i < n; ++i)
            if (at[i] < 0 || (at[i] + map.box[i] > map.dims[i] && !(map.fill && i > 0)))
                fail({here}, "a TMA copy in %s reads elements %d..%d of dim %d (innermost first), which has %llu: the "
                     "hardware fills what is outside with zeros, which no tile here means", who(t).c_str(), at[i],
                     at[i] + int(map.box[i]) - 1, i, map.dims[i]);
        for (const Bulk* other : b->bulks) {  // a copy over bytes another copy in flight has yet to write
            if (static_cast<unsigned char*>(dst) >= other->dst + other->data.size() ||
                other->dst >= static_cast<unsigned char*>(dst) + bytes)
                continue;
            if (find_mbarrier(b, other->bar, other->site).phase != other->phase)  // and never will: `land_bulks`
                fail({other->site}, "a TMA copy issued in phase %u of the mbarrier at %p lands after that phase "
                     "completed without its bytes: an mbarrier.expect_tx for them is missing or short", other->phase,
                     other->bar);
            fail({other->site, here}, "a TMA copy in %s writes %zu bytes at %p over those of a copy still in flight "
                 "(its mbarrier phase not yet waited for): a stage refilled before its last copy landed",
                 who(t).c_str(), bytes, dst);
        }
        bulk->dst = static_cast<unsigned char*>(dst);
        bulk->bar = bar;
        bulk->site = here;
        bulk->phase = m.phase;
        bulk->data.resize(bytes);
    }
    const size_t row = size_t(map.box[0]) * map.elem;  // a multiple of 16 bytes (`tensor_map`)
    for (size_t r = 0; r < bytes / row; ++r) {
        size_t from = size_t(at[0]) * map.elem, rest = r;
        bool outside = false;  // a row past an outer dim's end (a map with `fill`): zeros, nothing read
        for (int i = 1; i < n; ++i) {
            const unsigned long long k = at[i] + rest % map.box[i];
            outside = outside || k >= map.dims[i];
            from += k * map.strides[i];
            rest /= map.box[i];
        }
        for (size_t c = 0; c < row; c += 16) {
            const size_t o = r * row + c;
            unsigned char* into = bulk->data.data() + (map.swizzle ? o ^ ((o >> 7 & 7) << 4) : o);
            if (outside)
                std::memset(into, 0, 16);
            else
                std::memcpy(into, map.base + from + c, 16);
        }
    }
    std::memset(dst, 0xFF, bytes);
    {
        Quiet quiet;
        Buffer* into = shared_buffer(b, dst, bytes);
        std::memset(into->seen.data() + (bulk->dst - into->mem), 0xFF, bytes);
        b->bulks.push_back(bulk);
    }
    release(&bulk->sync);
}

// The TMA copies that complete bytes of `bar`, landed now, oldest first (by a thread that waits for their phase, or
// before the next phase's first arrival or expected bytes: `settle_phase`): their bytes written as the threads and
// the async proxy see them. Whether any was.
static bool land_bulks(Block* b, const void* bar) {
    bool any = false;
    for (;;) {
        Bulk* bulk = nullptr;
        char* sync;
        {
            Quiet quiet;
            for (size_t i = 0; i < b->bulks.size() && !bulk; ++i)
                if (b->bulks[i]->bar == bar) bulk = b->bulks[i], b->bulks.erase(b->bulks.begin() + i);
            if (!bulk) return any;
            Mbarrier& m = find_mbarrier(b, bar, bulk->site);
            if (m.phase != bulk->phase)
                fail({bulk->site}, "a TMA copy issued in phase %u of the mbarrier at %p lands after that phase completed "
                     "without its bytes: an mbarrier.expect_tx for them is missing or short", bulk->phase, bar);
            sync = &m.sync[m.phase % 2];
        }
        any = true;
        acquire(&bulk->sync);
        std::memcpy(bulk->dst, bulk->data.data(), bulk->data.size());
        release(sync);
        Quiet quiet;
        Buffer* into = shared_buffer(b, bulk->dst, bulk->data.size());
        std::memcpy(into->seen.data() + (bulk->dst - into->mem), bulk->data.data(), bulk->data.size());
        Mbarrier& m = find_mbarrier(b, bar, bulk->site);
        m.tx -= static_cast<long>(bulk->data.size());
        if (m.tx < 0 && m.pending == 0)
            fail({bulk->site}, "TMA copies deliver %ld bytes more than the phase of the mbarrier at %p expects: an "
                 "mbarrier.expect_tx is short", -m.tx, bar);
        complete_if_due(b, m, bar);
        delete bulk;
    }
}

void mbarrier_wait(void* bar, unsigned parity, const char* file, int line) {
    Thread* t = self();
    const Site here{file, line, "mbarrier.try_wait.parity"};
    PRISM_BANKS_DO(sync(t, false));
    for (;;) {
        char* sync;
        bool done;
        Thread* owner = nullptr;
        size_t k = 0;
        {
            Quiet quiet;
            Mbarrier& m = find_mbarrier(t->block, bar, here);
            done = m.phase % 2 != (parity & 1);
            sync = &m.sync[(m.phase + 1) % 2];  // the last completed phase's
            for (Thread* o : t->block->threads) {
                for (k = 0; k < o->landings.size() && o->landings[k].bar != bar; ++k) {}
                if (k < o->landings.size()) {
                    owner = o;
                    break;
                }
            }
        }
        if (done) {
            acquire(sync);
            return;
        }
        if (land_bulks(t->block, bar)) continue;
        if (owner) {
            land(owner, k);
            continue;
        }
        {
            Quiet quiet;
            t->state = State::kMbarrier;
            t->waits_on = bar;
            t->site = here;
        }
        yield();
    }
}

void defer() {
    {
        Quiet quiet;
        self()->state = State::kDeferred;
    }
    yield();
}

// -- named barriers: bar.sync (arrive and wait) and bar.arrive (arrive only), an id 1-15 and a thread count ----
void named_barrier(int id, int count, bool wait, const char* file, int line) {
    Thread* t = self();
    Block* b;
    char* sync;
    bool blocked;
    const Site here{file, line, wait ? "bar.sync" : "bar.arrive"};
    PRISM_BANKS_DO(sync(t, false));
    {
        Quiet quiet;
        b = t->block;
        if (id < 1 || id > 15) fail({here}, "%s %d: the named barriers are 1-15 (0 is __syncthreads)", here.what, id);
        if (count < kWarp || count % kWarp || count > static_cast<int>(b->threads.size()))
            fail({here}, "%s %d, %d: the count is whole warps of the %zu-thread block", here.what, id, count,
                 b->threads.size());
        Named& n = b->named[id];
        if (n.arrived == 0) {
            n.count = count;
            n.site = here;
        } else if (n.count != count) {
            fail({n.site, here}, "named barrier %d: %s counts %d threads, an arrival before it %d", id, who(t).c_str(),
                 count, n.count);
        }
        if (std::find(n.in.begin(), n.in.end(), t) != n.in.end())
            fail({n.site, here}, "%s arrives twice at named barrier %d before it completes", who(t).c_str(), id);
        sync = &n.sync[n.generation % 2];
    }
    release(sync);
    {
        Quiet quiet;
        Named& n = b->named[id];
        n.in.push_back(t);
        if (wait) {
            t->state = State::kNamed;
            t->site = here;
            n.waiting.push_back(t);
        }
        if (++n.arrived == n.count) {
            for (Thread* o : n.waiting) o->state = State::kReady;
            n.waiting.clear();
            n.in.clear();
            n.arrived = 0;
            ++n.generation;
        }
        blocked = wait && t->state != State::kReady;
    }
    if (blocked) yield();
    if (wait) acquire(sync);
}

// -- the scheduler ------------------------------------------------------------------------------------------------
[[noreturn]] static void deadlock(const std::vector<Block*>& wave) {
    for (Block* b : wave) {
        std::vector<int> done, at_barrier, at_warp;
        std::vector<std::pair<Site, std::vector<int>>> at_other;  // by where they wait (a named barrier, an mbarrier)
        Site barrier_site, warp_site;
        for (Thread* t : b->threads) {
            if (t->state == State::kDone) done.push_back(t->linear);
            if (t->state == State::kBarrier) at_barrier.push_back(t->linear), barrier_site = t->site;
            if (t->state == State::kWarp) at_warp.push_back(t->linear), warp_site = t->site;
            if (t->state == State::kNamed || t->state == State::kMbarrier) {
                auto same = std::find_if(at_other.begin(), at_other.end(), [&](const auto& g) {
                    return g.first.line == t->site.line && std::strcmp(g.first.file, t->site.file) == 0;
                });
                if (same == at_other.end()) at_other.push_back({t->site, {}}), same = at_other.end() - 1;
                same->second.push_back(t->linear);
            }
        }
        if (at_barrier.empty() && at_warp.empty() && at_other.empty()) continue;
        std::string text = "block (" + std::to_string(b->idx.x) + "," + std::to_string(b->idx.y) + "," +
                           std::to_string(b->idx.z) + ") cannot go on:";
        if (!at_barrier.empty())
            text += " threads " + ranges(at_barrier) + " wait at the barrier at " + where(barrier_site).c_str() + ";";
        if (!at_warp.empty())
            text += " threads " + ranges(at_warp) + " wait for their warps at " + where(warp_site).c_str() + " (" +
                    warp_site.what + ");";
        for (const auto& [site, threads] : at_other)
            text += " threads " + ranges(threads) + " wait at " + where(site).c_str() + " (" + site.what +
                    ") for arrivals that never come;";
        if (!done.empty()) text += " threads " + ranges(done) + " have finished;";
        text += " a barrier or warp collective not reached by every thread";
        fail({!at_barrier.empty() ? barrier_site : !at_warp.empty() ? warp_site : at_other[0].first}, "%s", text.c_str());
    }
    fail({}, "no emulated thread can go on");
}

static void run_wave(const std::vector<prism_dim3>& blocks) {
    Runtime& r = rt();
    const Launch& L = *r.launch;
    const int n = static_cast<int>(L.block.x * L.block.y * L.block.z);
    std::vector<Block*> wave;
    {
        Quiet quiet;
        for (const prism_dim3& idx : blocks) {
            Block* b = new Block;
            b->idx = idx;
            b->warps.resize((n + kWarp - 1) / kWarp);
            for (int i = 0; i < n; ++i) {
                Thread* t = fiber(r.next_fiber++ % r.slots);
                t->block = b;
                t->linear = i;
                t->idx = {unsigned(i) % L.block.x, unsigned(i) / L.block.x % L.block.y, unsigned(i) / (L.block.x * L.block.y)};
                t->state = State::kReady;
                t->copies.clear();
                t->groups.clear();
                t->landings.clear();
                t->issued = 0;
#if defined(PRISM_ASAN)
                __asan_unpoison_memory_region(t->stack, r.stack_bytes);
#endif
                start_context(&t->ctx, t->stack, r.stack_bytes, entry);
#if defined(PRISM_TSAN)
                const std::string name = L.kernel + std::string(": ") + who(t).c_str();
                __tsan_set_fiber_name(t->fiber, name.c_str());
#endif
                b->threads.push_back(t);
            }
            wave.push_back(b);
        }
    }
    for (;;) {
        bool ran = false, done = true;
        for (Block* b : wave)
            for (Thread* t : b->threads) {
                if (t->state == State::kReady) {
                    switch_to(nullptr, t);
                    ran = true;
                }
                done = done && t->state == State::kDone;
            }
        if (done) break;
        if (ran) continue;
        for (Block* b : wave) {  // one warp that waits for its wgmma goes on; the others' stay in flight
            for (Thread* t : b->threads)
                if (t->state == State::kDeferred) {
                    for (Thread* o : b->threads)
                        if (o->linear / kWarp == t->linear / kWarp && o->state == State::kDeferred) o->state = State::kReady;
                    ran = true;
                    break;
                }
            if (ran) break;
        }
        if (!ran) deadlock(wave);
    }
    for (Block* b : wave) {
        acquire(&b->exit_sync);
        Quiet quiet;
        for (int id = 1; id < 16; ++id)
            if (b->named[id].arrived)
                fail({b->named[id].site}, "block (%u,%u,%u) ends with %d of named barrier %d's %d arrivals made: a bar.arrive "
                     "no bar.sync waited for", b->idx.x, b->idx.y, b->idx.z, b->named[id].arrived, id, b->named[id].count);
        for (const Bulk* bulk : b->bulks) {
            if (find_mbarrier(b, bulk->bar, bulk->site).phase != bulk->phase)
                fail({bulk->site}, "block (%u,%u,%u) ends with a TMA copy whose mbarrier phase completed without its "
                     "bytes: an mbarrier.expect_tx for them is missing or short", b->idx.x, b->idx.y, b->idx.z);
            fail({bulk->site}, "block (%u,%u,%u) ends with a TMA copy (issued at %s) that never landed: no thread waited "
                 "for the mbarrier phase its bytes complete (or that phase's mbarrier.expect_tx is missing)", b->idx.x,
                 b->idx.y, b->idx.z, where(bulk->site).c_str());
        }
        for (const WgmmaIssue& issue : b->wgmma_issues)
            fail({issue.site}, "block (%u,%u,%u) ends with wgmma %zu of warpgroup %d issued by %d of its 4 warps "
                 "(warp %d first): the warps of a warpgroup issue each wgmma together", b->idx.x, b->idx.y, b->idx.z,
                 issue.k, issue.group, issue.warps, issue.warp);
        PRISM_BANKS_DO(block_done(b));
        for (Buffer& buf : b->buffers) std::free(buf.base);
        delete b;
    }
}

// Run `blocks` of a launch (all of its grid when empty), `per_wave` blocks live at a time.
static void launch(const Launch& L, std::vector<prism_dim3> blocks, size_t per_wave) {
    Runtime& r = rt();
#if defined(PRISM_TSAN) || defined(PRISM_ASAN)
    static bool hooked = false;
    if (!hooked) __sanitizer_set_death_callback(on_death), hooked = true;
#endif
#if defined(PRISM_TSAN)
    if (!r.main_fiber) r.main_fiber = __tsan_get_current_fiber();
#endif
    if (blocks.empty())
        for (unsigned z = 0; z < L.grid.z; ++z)
            for (unsigned y = 0; y < L.grid.y; ++y)
                for (unsigned x = 0; x < L.grid.x; ++x) blocks.push_back({x, y, z});
    const size_t threads = L.block.x * L.block.y * L.block.z;
    per_wave = per_wave ? per_wave : 1;
    // One warp more fibers than a wave needs, so a thread of the next wave seldom runs on the fiber the same
    // thread of an earlier block used: ThreadSanitizer orders what one fiber does, and would miss that race.
    r.slots = std::max(r.slots, per_wave * threads + kWarp);
    r.launch = &L;
    release(&r.launch_sync);
    for (size_t i = 0; i < blocks.size(); i += per_wave)
        run_wave(std::vector<prism_dim3>(blocks.begin() + i, blocks.begin() + std::min(blocks.size(), i + per_wave)));
    acquire(&r.done_sync);
    PRISM_BANKS_DO(launch_done(L));
    r.launch = nullptr;
}

// -- the harness: tensors in host memory, kernels launched as a command file says ----------------------------------
TensorMap tensor_map(const void* base, int elem, const std::vector<unsigned long long>& dims,
                     const std::vector<unsigned>& box, int swizzle, int fill) {
    TensorMap m;
    m.fill = fill;
    m.base = static_cast<const unsigned char*>(base);
    m.rank = static_cast<int>(dims.size());
    m.elem = elem;
    m.swizzle = swizzle;
    unsigned long long stride = elem;
    for (int i = 0; i < m.rank; ++i) {
        m.dims[i] = dims[m.rank - 1 - i];
        m.box[i] = box.size() == dims.size() ? box[m.rank - 1 - i] : 0;
        m.strides[i] = stride;
        stride *= m.dims[i];
    }
    bool ok = m.rank >= 1 && m.rank <= 5 && box.size() == dims.size() && reinterpret_cast<uintptr_t>(base) % 16 == 0
              && (swizzle == 0 || swizzle == 128) && m.box[0] * elem % 16 == 0
              && (swizzle == 0 || m.box[0] * elem <= unsigned(swizzle));
    for (int i = 0; i < m.rank && ok; ++i) ok = m.box[i] >= 1 && m.box[i] <= 256 && m.box[i] <= m.dims[i] && m.strides[i] % (i ? 16 : 1) == 0;
    if (!ok) fail({}, "a tensor map the CUDA driver would refuse: rank %zu, box of %zu dims (each 1-256, the innermost a "
                  "multiple of 16 bytes, at most the swizzle's %d), outer strides multiples of 16 bytes", dims.size(),
                  box.size(), swizzle);
    return m;
}

[[noreturn]] static void harness_error(const std::string& text) {
    std::fprintf(stderr, "prism-emulation: harness: %s\n", text.c_str());
    _exit(2);
}

// On Linux the kernel kills the emulation when prismc, which started it, dies however it dies (a SIGKILL
// included), so that no orphan goes on emulating for minutes. PRISM_PARENT is prismc's pid: a parent gone before
// the request took effect leaves this process another parent.
static void die_with_parent() {
#if defined(__linux__)
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    const char* parent = std::getenv("PRISM_PARENT");
    if (parent && std::atol(parent) != static_cast<long>(getppid())) _exit(2);
#endif
}

int harness(int argc, char** argv, const std::vector<TensorEntry>& tensors, const std::vector<KernelEntry>& kernels) {
    die_with_parent();
    if (argc != 2) harness_error("usage: emulate COMMANDS");
    FILE* in = std::fopen(argv[1], "r");
    if (!in) harness_error(std::string("cannot read ") + argv[1]);
    std::vector<unsigned char*> memory;
    for (const TensorEntry& t : tensors) {
        // exactly the tensor's bytes, so that AddressSanitizer sees a read or write past its end
        memory.push_back(static_cast<unsigned char*>(std::malloc(t.bytes ? t.bytes : 1)));
        std::memset(memory.back(), 0xFF, t.bytes);
    }
    size_t per_wave = 8;
    char word[32], path[4096], how[16];
    int index;
    while (std::fscanf(in, "%31s", word) == 1) {
        const std::string w = word;
        if (w == "wave") {
            if (std::fscanf(in, "%zu", &per_wave) != 1) harness_error("wave: a count");
            continue;
        }
        if (std::fscanf(in, "%d", &index) != 1 || index < 0) harness_error(w + ": an index");
        if (w == "launch") {
            if (index >= static_cast<int>(kernels.size())) harness_error("launch: no such kernel");
            const KernelEntry& k = kernels[index];
            std::vector<prism_dim3> blocks;
            if (std::fscanf(in, "%15s", how) != 1) harness_error("launch: all or a count");
            if (std::string(how) != "all") {
                const long n = std::atol(how);
                for (long i = 0; i < n; ++i) {
                    prism_dim3 b;
                    if (std::fscanf(in, "%u %u %u", &b.x, &b.y, &b.z) != 3) harness_error("launch: a block index");
                    if (b.x >= k.grid.x || b.y >= k.grid.y || b.z >= k.grid.z) harness_error("launch: a block outside the grid");
                    blocks.push_back(b);
                }
            }
            std::vector<void*> args;
            for (int a : k.args) args.push_back(memory[a]);
            const Launch L{k.name, k.fn, args.data(), k.grid, k.block, k.smem};
            launch(L, blocks, per_wave);
            continue;
        }
        if (index >= static_cast<int>(tensors.size())) harness_error(w + ": no such tensor");
        const TensorEntry& t = tensors[index];
        if (w == "fill") {
            if (std::fscanf(in, "%15s", how) != 1) harness_error("fill: nan or zero");
            std::memset(memory[index], std::string(how) == "zero" ? 0 : 0xFF, t.bytes);
            continue;
        }
        if (w != "load" && w != "save") harness_error("unknown command " + w);
        if (std::fscanf(in, " %4095[^\n]", path) != 1) harness_error(w + ": a path");
        FILE* f = std::fopen(path, w == "load" ? "rb" : "wb");
        if (!f) harness_error(std::string("cannot open ") + path);
        const size_t moved = w == "load" ? std::fread(memory[index], 1, t.bytes, f) : std::fwrite(memory[index], 1, t.bytes, f);
        std::fclose(f);
        if (moved != t.bytes) harness_error(std::string("short ") + w + " of " + t.name);
    }
    std::fclose(in);
    for (unsigned char* m : memory) std::free(m);
    return 0;
}

}  // namespace emu
}  // namespace prism
