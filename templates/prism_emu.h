// prism_emu.h: the runtime of the thread-faithful CPU emulation of generated CUDA (included by prism.cuh
// when PRISM_CPU is defined; never by nvcc).
//
// Every CUDA thread of a block is a fiber (a stack of its own and a saved context); the blocks of a wave are all
// live at once and their fibers take turns, so races between threads and between blocks are real
// interleavings, and ThreadSanitizer sees each fiber as a thread of its own (the __tsan_*_fiber API, with
// no synchronisation implied by a switch). A fiber runs until it reaches a barrier or a warp collective
// and then yields; nothing else orders two threads, as on a GPU.
//
//   __syncthreads()    a real barrier: a thread waits until every thread of its block has reached the same
//                      barrier (same file and line); a thread that finished, or one waiting elsewhere, is a
//                      divergent barrier and an error, not a hang. Under ThreadSanitizer every arrival
//                      releases and every departure acquires the block's barrier, so memory written before
//                      it is ordered before memory read after it, and nothing else is.
//   warp collectives   (shuffles, tensor-core fragments, ldmatrix, mma) wait for all 32 lanes of the warp at
//                      the same call with the full mask; the last lane to arrive performs the exchange for
//                      all of them. Lanes missing (finished, at a barrier, at another collective) are an
//                      error naming the lanes and lines.
//   shared memory      per block: each buffer a separate allocation filled with 0xFF bytes (a NaN in every
//                      float type), so AddressSanitizer finds a read past one buffer's end even where, on
//                      the GPU, the next buffer follows it. Buffers in use in different phases of the
//                      kernel (before, in and after its loop) may share bytes on the GPU: the emulation
//                      checks that those sharing are never in use at once, refills each with the NaN
//                      pattern where its use begins and ends, and under AddressSanitizer poisons it
//                      outside them, so a read of what another buffer left there is found.
//   wgmma              computed at the issue, written at the wait; a warp that reaches a wait for its batches
//                      runs again only when no other thread of the wave can go on, one such warp at a time.
//                      Its operands must be as the async proxy saw them at the block's last fence.proxy.async
//                      (`fence_proxy_async`), and a batch must begin with a wgmma.fence in every lane.
//   cp.async           copies are queued per thread: the source is read when the copy is issued, the
//                      destination is overwritten with the NaN pattern at once (its contents are undefined
//                      until the wait) and with the data only at the cp.async.wait_group that completes
//                      its group. Another thread sees it only after a barrier that follows that wait.
//   named barriers     bar.sync / bar.arrive with an id (1-15) and a thread count: a barrier completes when
//                      that many arrivals reach it, bar.sync waiting for it and bar.arrive not. The count must
//                      agree among the arrivals, a thread arrives once per completion, and a barrier left
//                      with arrivals when its block ends is an error.
//   mbarriers          in shared memory: init with an arrival count, arrive, and a wait for the completion of
//                      the phase of a given parity. cp.async.mbarrier.arrive.noinc is an arrival made when
//                      every copy the thread issued before it has completed: the emulation completes those
//                      copies as late as it can, when a thread must wait for that phase, so a read of the
//                      destination before the wait finds the NaN pattern.
//   TMA                cp.async.bulk.tensor of a box of a tensor map (`tensor_map`): the box is read at the issue;
//                      its destination holds the NaN pattern until a thread waits for the mbarrier phase whose
//                      bytes it completes (mbarrier.arrive.expect_tx says how many a phase waits for), or until
//                      the next phase of that mbarrier begins, and there it lands as both the threads and the
//                      async proxy see it, in the 128-byte swizzle where the map has it. The mbarrier must be fenced for the async proxy first (fence.mbarrier_init); a box
//                      past the tensor's end, a phase completed without a copy's bytes, or more bytes than a phase
//                      expects are errors.
//
// This header holds what kernels and prism.cuh see: the runtime's state, the primitives' entry points and
// ThreadSanitizer's view of the runtime's bookkeeping; prism_emu.cc defines the rest, compiled once per set of
// flags into an object each build links (backend/emulate.py).
//
// Errors the emulation finds itself are printed as one line "prism-emulation: kernel K: ..." followed by
// "prism-emulation-at: FILE:LINE" lines, and the process exits with status 3. Sanitizer reports are
// printed by the sanitizer; a death callback adds the emulated thread that was running.
#pragma once

// The interface prism.cuh's emulated forms are written against: raised when they must change with this header, so
// that an output directory's prism.cuh from before is refused in words (`prismc verify`), not by a compile error.
#define PRISM_EMU_INTERFACE 2

#if !defined(__x86_64__) || !defined(__LP64__) || !defined(__ELF__) || defined(PRISM_EMU_UCONTEXT)
#include <ucontext.h>
#endif

#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

#if defined(__SANITIZE_THREAD__)
#define PRISM_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PRISM_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define PRISM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PRISM_ASAN 1
#endif
#endif
#if defined(PRISM_TSAN)
#include <sanitizer/tsan_interface.h>
extern "C" void __tsan_ignore_thread_begin(void);  // in the runtime, not in every compiler's header
extern "C" void __tsan_ignore_thread_end(void);
#endif
#if defined(PRISM_ASAN)
#include <sanitizer/asan_interface.h>
#endif
#if defined(PRISM_TSAN) || defined(PRISM_ASAN)
#include <sanitizer/common_interface_defs.h>
#endif

struct prism_dim3 {
    unsigned x, y, z;
};

namespace prism {
namespace emu {

constexpr int kWarp = 32;
constexpr int kLastPhase = 5;  // a kernel's phases 0-2, and 3-5 for a combining kernel run after it in its launch
constexpr int kExitFinding = 3;  // the exit status of an emulation finding (sanitizers use their own)

struct Site {
    const char* file = nullptr;
    int line = 0;
    const char* what = "";
};

enum class State { kReady, kBarrier, kWarp, kNamed, kMbarrier, kDeferred, kDone };

struct Block;

struct Copy {  // one queued cp.async
    size_t seq;  // the thread's copies issued before it
    unsigned char* dst;
    unsigned char data[16];
    int size;
    Site site;
};

// A fiber's saved context. On x86-64 (ELF: Linux, the BSDs), the stack pointer it was switched away at, its
// callee-saved registers pushed below it (`switch_context` in prism_emu.cc): glibc's swapcontext also saves and
// restores the signal mask, a system call at every switch, which took most of an emulation's time (a fiber switches
// twice at each barrier and warp collective). Elsewhere a ucontext (and on x86-64 with PRISM_EMU_UCONTEXT defined:
// how that path is tested).
#if defined(__x86_64__) && defined(__LP64__) && defined(__ELF__) && !defined(PRISM_EMU_UCONTEXT)
struct Context {
    void* sp = nullptr;
};
#else
using Context = ucontext_t;
#endif

struct Thread {
    Context ctx;
    char* stack = nullptr;
    void* fiber = nullptr;  // ThreadSanitizer's fiber
    void* fake_stack = nullptr;  // AddressSanitizer's, while switched away
    Block* block = nullptr;
    prism_dim3 idx{0, 0, 0};
    int linear = 0;
    State state = State::kDone;
    Site site;  // where it waits
    std::vector<Copy> copies;  // issued, not yet completed
    std::vector<size_t> groups;  // copies.size() at each commit, oldest first
    size_t issued = 0;  // copies issued so far
    struct Landing {  // a cp.async.mbarrier.arrive: an arrival at `bar` once the copies before `seq` complete
        size_t seq;
        void* bar;
        Site site;
    };
    std::vector<Landing> landings;  // not yet made, oldest first
    char landing_sync = 0;  // released at each, acquired by the thread that completes the copies
    const void* waits_on = nullptr;  // the mbarrier it waits at (State::kMbarrier)
    bool wgmma_fenced = false;  // a wgmma.fence since its warp's last wgmma.commit_group
};

// One warp's wgmma in flight (prism.cuh): issued, not yet completed by a wgmma.wait_group. The result is
// computed at the issue and written to the accumulators only at that wait (they hold NaN meanwhile: on the
// GPU they are undefined until it); the operands are read at the issue and again at the wait, and must not
// have changed, as the tensor cores may read them at any time in between.
struct WgmmaFlight {
    Site site;
    std::vector<float*> d;  // each lane's accumulators
    std::vector<float> value;  // the results, lane after lane
    std::vector<float> operands;  // A's and B's elements as read at the issue
    std::vector<unsigned char> lanes;  // the 32 lanes' operand records (prism.cuh's WgmmaIn), as issued
    void (*read)(const unsigned char* lanes, std::vector<float>& operands) = nullptr;  // reads them again
};

struct Warp {
    // ThreadSanitizer synchronises the lanes of a collective on sync[generation % 2]: a lane that hurries on
    // to the next collective releases the other address, so a slow lane's acquire never picks up what the
    // fast one did after this collective.
    char sync[2] = {0, 0};
    unsigned generation = 0;
    int arrived = 0;
    Site site;
    unsigned mask = 0;
    const void* in[kWarp];
    void* out[kWarp];
    void (*op)(const void* const* in, void* const* out) = nullptr;
    std::vector<WgmmaFlight> wgmma;  // in flight, oldest first
    std::vector<size_t> wgmma_groups;  // the sizes of the committed groups among them, oldest first
    size_t wgmma_issued = 0;  // how many wgmma this warp has issued
};

// The operands the first warp of a warpgroup to issue its k-th wgmma gave it: the warpgroup's four warps issue
// one product together, so the other three must give the same (A's descriptor where A is in shared memory,
// B's, the instruction's shape and type) before it is complete.
struct WgmmaIssue {
    int group;  // the warpgroup
    size_t k;
    uintptr_t operands[7];
    Site site;
    int warp, warps;  // the first warp's place in the warpgroup; how many of the four have issued it
};

struct Buffer {
    size_t offset, bytes;
    unsigned char* mem;  // at base + offset % 1024: the GPU's place within a 1024-byte swizzle atom (wgmma)
    unsigned char* base;
    int first, last;  // the phases it is in use (`shared`)
    std::vector<unsigned char> seen;  // its bytes as the async proxy (wgmma) sees them (`fence_proxy_async`)
};

struct Named {  // one of a block's hardware barriers 1-15 (bar.sync / bar.arrive)
    int count = 0, arrived = 0;
    std::vector<Thread*> waiting, in;  // those that wait for it; every arrival of this completion
    Site site;
    char sync[2] = {0, 0};
    unsigned generation = 0;
};

struct Mbarrier {  // an mbarrier object in shared memory
    int count = 0, pending = 0;  // arrivals per phase; still to come in this one
    long tx = 0;  // bytes this phase expects (mbarrier.expect_tx) less those TMA copies delivered (complete_tx)
    unsigned phase = 0;  // completed phases
    char sync[2] = {0, 0};  // phase p's arrivals release sync[p % 2]; its waiters acquire it
    Site init;
    const Thread* init_by = nullptr;
    bool fenced = false;  // its initialisation made visible to the async proxy (fence.mbarrier_init)
};

// A tensor map: what a TMA copy reads (cuTensorMapEncodeTiled on the host; `tensor_map` in the harness here): a
// tensor in global memory, dims innermost first, and the box one copy brings; `swizzle` 128 for the 128-byte swizzle.
struct TensorMap {
    const unsigned char* base = nullptr;
    int rank = 0, elem = 0, swizzle = 0;  // element bytes; 128 or 0 (none)
    unsigned long long dims[5] = {}, strides[5] = {};  // elements per dim; bytes from one position of it to the next
    unsigned box[5] = {};
    int fill = 0;  // a tensor read in place (`kernels.masking.read_in_place`): the zeros the hardware fills past its
                   // outer dims' ends are meant, where they are an error elsewhere
};

struct Bulk {  // one TMA copy in flight: the box read at the issue, written where it lands (`land_bulks`)
    unsigned char* dst;
    std::vector<unsigned char> data;
    const void* bar;
    Site site;
    unsigned phase;  // the mbarrier's phase it was issued in, whose completion waits for its bytes
    char sync = 0;  // released by the issuing thread, acquired by the thread that lands it
};

struct Block {
    prism_dim3 idx{0, 0, 0};
    std::vector<Thread*> threads;
    std::vector<Warp> warps;
    std::vector<Buffer> buffers;
    int phase = 0;  // of the kernel: 0 before its loop, 1 in it, 2 after it; 3-5 those of a combining kernel after it
    int at_barrier = 0;
    Site barrier;
    char sync[2] = {0, 0};  // where ThreadSanitizer synchronises barrier generation g: sync[g % 2] (as in Warp)
    unsigned generation = 0;
    char exit_sync = 0;
    bool vote[2] = {false, false};  // __syncthreads_or of barrier generation g: vote[g % 2]
    Named named[16];
    std::deque<std::pair<const void*, Mbarrier>> mbarriers;  // a deque: their sync addresses stay put
    std::vector<WgmmaIssue> wgmma_issues;  // each warpgroup's wgmma issued by some of its warps, not yet all four
    std::vector<Bulk*> bulks;  // TMA copies issued, not yet landed, oldest first
};

struct Launch {
    const char* kernel;
    void (*fn)(void* const* args);
    void* const* args;
    prism_dim3 grid, block;
    size_t smem;
};

struct Runtime {
    Context main;
    Thread* current = nullptr;
    const Launch* launch = nullptr;
    std::vector<Thread*> pool;  // fibers and stacks, reused from wave to wave
    size_t next_fiber = 0, slots = 0;  // fibers are taken in turn, `slots` of them
    void* main_fiber = nullptr;
    const void* main_stack = nullptr;
    size_t main_stack_size = 0;
    char launch_sync = 0, done_sync = 0;
    Site op_site;  // the warp collective being performed, for the checks its exchange makes
    bool async_view = false;  // wgmma operands read as the async proxy sees them (`Buffer::seen`)
    size_t stack_bytes = size_t(256) << 10;
};

#if defined(PRISM_TSAN)
#define PRISM_UNSEEN __attribute__((no_sanitize("thread"), noinline))
#else
#define PRISM_UNSEEN
#endif

Runtime& rt();
// The running thread, and its indices: bookkeeping that kernel code reads, unseen by ThreadSanitizer.
PRISM_UNSEEN Thread* self();
PRISM_UNSEEN prism_dim3 block_idx();
PRISM_UNSEEN prism_dim3 thread_idx();

// -- ThreadSanitizer: runtime bookkeeping is invisible to it; only the kernel's own accesses count ----------
struct Quiet {
#if defined(PRISM_TSAN)
    Quiet() { __tsan_ignore_thread_begin(); }
    ~Quiet() { __tsan_ignore_thread_end(); }
#endif
};
struct Visible {  // inside a Quiet region (a warp collective's exchange): the kernel's own memory accesses
#if defined(PRISM_TSAN)
    Visible() { __tsan_ignore_thread_end(); }
    ~Visible() { __tsan_ignore_thread_begin(); }
#endif
};
inline void release(void* addr) {
#if defined(PRISM_TSAN)
    __tsan_release(addr);
#else
    (void)addr;
#endif
}
inline void acquire(void* addr) {
#if defined(PRISM_TSAN)
    __tsan_acquire(addr);
#else
    (void)addr;
#endif
}

// -- reports ----------------------------------------------------------------------------------------------------
struct Text {  // a part of a message, held without std::string (which kernels' builds need not parse)
    char s[512];
    const char* c_str() const { return s; }
};
Text who(const Thread* t);  // "block (x,y,z) thread T (warp W, lane L)"
Text where(const Site& s);  // "FILE:LINE"

[[noreturn]] void fail(const std::vector<Site>& at, const char* fmt, ...);

// -- shared memory --------------------------------------------------------------------------------------------------
void declare_shared(size_t bytes, const char* file, int line);

// A buffer in use in phases first..last of the kernel (0 before its loop, 1 in it, 2 after it): buffers whose
// phases meet must not share bytes; those that do not may (the GPU then holds one where the other was).
void* shared(size_t offset, size_t bytes, int first, int last, const char* file, int line);

// The block enters phase p (1 before its loop's first copies, 2 after it): the first thread to arrive fills
// the buffers whose use ends or begins here with the NaN pattern, as the bytes they share on the GPU hold
// another buffer's data, and under AddressSanitizer poisons those not in use now. Later threads find the
// block there already. A barrier comes first wherever the phase before did any work (the code generator's
// prologue, loop-invariant steps and loop steps each end with one), so no thread still uses what is refilled.
void phase(int p, const char* file, int line);

const Buffer* buffer_of(const Block* b, const void* p, size_t bytes);
bool in_shared(const Block* b, const void* p, size_t bytes);

// fence.proxy.async.shared::cta. The tensor cores read wgmma's operands from shared memory through the async
// proxy, which sees what the threads wrote there (st.shared, and cp.async as it lands) only once the writing
// thread has executed this fence after the write. Each buffer keeps a copy of its bytes as that proxy sees
// them, taken again whenever a thread of the block executes the fence; a wgmma reads the live bytes and
// must find them equal to that copy (`wgmma_op`). So a write with no fence after it before the wgmma is
// found; the copy is of every thread's writes, not only the fencing thread's, so a write left unfenced by
// its own thread while another thread fences is not (the generated code fences in every thread at once).
void fence_proxy_async();

// -- barriers and warp collectives ----------------------------------------------------------------------------------
void barrier(const char* file, int line);

// __syncthreads_or: the barrier, and whether any thread of the block passed a true `vote` to it.
bool barrier_or(bool vote, const char* file, int line);

void collective(const char* what, unsigned mask, const char* file, int line, const void* in, void* out,
                void (*op)(const void* const*, void* const*));

// -- cp.async: copies queued per thread, completed by the wait that covers their group -----------------------------
void cp_async(void* dst, const void* src, int size, const char* file, int line);  // src null: zeros, nothing read

void cp_async_commit();

// cp.async.wait_group n: every committed group but the n most recent is complete, and its data written.
void cp_async_wait(int n);

// -- mbarriers: arrivals counted per phase; cp.async.mbarrier.arrive made when the thread's copies complete ----
void mbarrier_init(void* bar, int count, const char* file, int line);

// fence.mbarrier_init: the mbarriers this thread initialised are visible to the async proxy (the TMA unit that
// completes their bytes) from here.
void mbarrier_init_fence();

// mbarrier.arrive.expect_tx: the phase waits for `bytes` more from TMA copies, and this is one of its arrivals.
void mbarrier_expect_tx(void* bar, unsigned bytes, const char* file, int line);

void mbarrier_arrive(void* bar, const char* file, int line);

// cp.async.mbarrier.arrive.noinc: an arrival at `bar` once every copy this thread issued so far completes.
void cp_async_mbarrier_arrive(void* bar, const char* file, int line);

// -- TMA: a box of a tensor copied into shared memory by one instruction, completing bytes of an mbarrier ----------
// cp.async.bulk.tensor (tile mode, the destination in this block's shared memory): the box of `map` at
// coordinates at[0..n) (innermost first) is read now and written when it lands (`land_bulks`); until then the
// destination is undefined (the NaN pattern), as the threads and the async proxy see it. The box lands dim 0 fastest, in rows of box[0] elements; with the 128-byte swizzle byte o of it lands
// at o ^ (o >> 7 & 7) << 4 (address bits 4-6 XOR bits 7-9 of a 1024-byte aligned destination: wgmma's layout).
void tma_load(void* dst, const TensorMap& map, void* bar, const int* at, int n, const char* file, int line);

// mbarrier.try_wait.parity in a loop: until the phase of that parity has completed (the current one has the
// other parity). A thread that would wait completes the copies whose arrivals the phase needs first.
void mbarrier_wait(void* bar, unsigned parity, const char* file, int line);

// A thread about to wait for work in flight (its warp's wgmma batches) first lets every other thread of the
// wave run as far as it can: the scheduler resumes it only when nothing else can go on, and then one such
// warp at a time. So the tensor cores read their operands as late as the code allows, and a write the code
// does not order after the wait comes first, and is found there.
void defer();

// -- named barriers: bar.sync (arrive and wait) and bar.arrive (arrive only), an id 1-15 and a thread count ----
void named_barrier(int id, int count, bool wait, const char* file, int line);

// -- the count of shared-memory wavefronts (the "banks" build: prism_banks.cc) -----------------------------------------
#if defined(PRISM_BANKS)
namespace banks {
void sync(Thread* t, bool done);  // t reaches a barrier, a warp collective or an mbarrier wait (done: its end)
void quiet(bool on);  // a collective's exchange runs: its accesses are the runtime's
void copy(const void* dst, int size, const char* file, int line);  // a cp.async's write of shared memory
void rows(const void* const* row, int n, const char* file, int line);  // ldmatrix's n row addresses, 8 a matrix
void block_done(const Block* b);
void launch_done(const Launch& L);
}  // namespace banks
#define PRISM_BANKS_DO(call) banks::call
#else
#define PRISM_BANKS_DO(call) ((void)0)
#endif

// -- the scheduler ------------------------------------------------------------------------------------------------

}  // namespace emu
}  // namespace prism

// -- the harness: tensors in host memory, kernels launched as a command file says ----------------------------------
// Commands, one per line (tensors and kernels by their index in the tables the generated harness passes):
//     load T PATH          read the tensor's bytes from PATH
//     fill T nan|zero      every byte 0xFF (NaN in every float type) or 0
//     launch K all         every block of kernel K's grid
//     launch K N x y z ... N blocks of it
//     save T PATH          write the tensor's bytes to PATH
//     wave N               blocks live at once from now on
namespace prism {
namespace emu {

struct TensorEntry {
    const char* name;
    size_t bytes;
};

struct KernelEntry {
    const char* name;
    void (*fn)(void* const* args);
    std::vector<int> args;
    prism_dim3 grid, block;
    size_t smem;
};

// The tensor map of a contiguous tensor (dims and box outer first, as the plan lists them) with the 128-byte swizzle
// (`swizzle` 128) or none: what the runtime has the CUDA driver encode (cuTensorMapEncodeTiled), held to the
// driver's rules for it.
TensorMap tensor_map(const void* base, int elem, const std::vector<unsigned long long>& dims,
                     const std::vector<unsigned>& box, int swizzle, int fill = 0);

int harness(int argc, char** argv, const std::vector<TensorEntry>& tensors, const std::vector<KernelEntry>& kernels);

}  // namespace emu
}  // namespace prism
