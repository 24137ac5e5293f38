// prism_banks.cc: the emulation's count of shared-memory wavefronts (backend/banks.py), compiled with prism_emu.cc
// into the runtime object of the "banks" build. That build compiles the kernels with the compiler's
// kernel-address instrumentation and calls to it (-fsanitize=kernel-address, every access an outlined call), and
// no sanitizer runtime: the calls land here. An access that falls in the running block's shared buffers is kept
// with its thread, its place in the code and its address as the GPU would have it (the buffer's offset).
//
// A warp's instruction is what its lanes do at one place in the code, the k-th time each gets there since the
// warp last synchronised (a barrier, a warp collective, an mbarrier wait): lanes that take a branch and lanes
// that do not agree again at the next one. The host compiler reads a row of adjacent elements one by one where
// nvcc reads them by one vector load (LDS.64, LDS.128), so an instruction whose every lane's access comes a few
// accesses after its access in one before (the same few in every lane), of the same kind and size, adjacent and
// within the same aligned 16 bytes, counts as part of that one, as nvcc merges them.
//
// Wavefronts, as the GPU's shared memory serves a warp's access: 32 banks of 4-byte words; the lanes go in phases
// of 128 bytes (all 32 lanes for accesses of 4 bytes or less, 16 for 8 bytes, 8 for 16); a phase takes as many
// wavefronts as the most distinct words any one bank holds among its lanes' (lanes reading the same word share
// it). Conflict-free, a phase takes one per 32 distinct words. ldmatrix (each 8x8 matrix a phase of 8 rows of 16
// bytes) and cp.async's writes (as the threads' 16-byte stores) are counted so too; wgmma's operands and TMA's
// copies, which the hardware reads and writes in its own swizzled order, are not.
#include "prism_emu.cc"

#include <algorithm>
#include <map>
#include <unordered_map>

extern "C" char __executable_start;  // the linker's: where the executable's image begins

namespace prism {
namespace emu {
namespace banks {

struct Lane {
    std::unordered_map<uintptr_t, uint32_t> seen;  // per place in the code: times reached since the last sync
    uint32_t epoch = 0;  // syncs passed
    uint32_t seq = 0;  // accesses made
};

struct Key {
    uint32_t epoch, k;
    uintptr_t site;
    bool operator==(const Key& o) const { return epoch == o.epoch && k == o.k && site == o.site; }
};
struct KeyHash {
    size_t operator()(const Key& k) const { return std::hash<uintptr_t>()(k.site) ^ (size_t(k.k) << 20) ^ (size_t(k.epoch) << 40); }
};
struct Access {
    int lane;
    uint32_t start, end, seq;
};
struct Group {  // one warp instruction: its lanes' accesses
    bool store;
    uint32_t elem;
    uintptr_t site;
    std::vector<Access> lanes;
};

struct Tally {
    unsigned long long wavefronts = 0, ideal = 0, accesses = 0;
};

struct BlockState {
    std::vector<Lane> lanes;
    std::vector<std::unordered_map<Key, Group, KeyHash>> warps;
};

constexpr uint32_t kDone = 0xFFFFFFFFu;

static std::unordered_map<const Block*, BlockState> g_blocks;
static std::map<uintptr_t, Tally> g_sites;  // this launch's, by place in the code
static std::map<uintptr_t, Site> g_named;  // places the runtime names (cp.async, ldmatrix): file and line
static Tally g_launch;
static unsigned long long g_blocks_done = 0;
static bool g_quiet = false;  // a warp collective's exchange: its accesses are the runtime's, counted apart

static BlockState& state(const Block* b) {
    BlockState& s = g_blocks[b];
    if (s.lanes.empty()) {
        s.lanes.resize(b->threads.size());
        s.warps.resize(b->warps.size());
    }
    return s;
}

// Wavefronts of one warp instruction: each lane's accesses (bytes [start, end) of the GPU's shared memory).
static Tally wavefronts(const std::vector<Access>& lanes) {
    uint32_t widest = 0;
    for (const Access& a : lanes) widest = std::max(widest, a.end - a.start);
    const int per = widest <= 4 ? 32 : widest <= 8 ? 16 : 8;
    Tally t;
    std::vector<uint32_t> words;
    for (int first = 0; first < kWarp; first += per) {
        words.clear();
        for (const Access& a : lanes)
            if (a.lane >= first && a.lane < first + per)
                for (uint32_t w = a.start / 4; w <= (a.end - 1) / 4; ++w) words.push_back(w);
        if (words.empty()) continue;
        std::sort(words.begin(), words.end());
        words.erase(std::unique(words.begin(), words.end()), words.end());
        int bank[32] = {};
        int most = 0;
        for (uint32_t w : words) most = std::max(most, ++bank[w % 32]);
        t.wavefronts += most;
        t.ideal += (words.size() + 31) / 32;
    }
    t.accesses = 1;
    return t;
}

static void add(uintptr_t site, const Tally& t) {
    Tally& s = g_sites[site];
    s.wavefronts += t.wavefronts, s.ideal += t.ideal, s.accesses += t.accesses;
    g_launch.wavefronts += t.wavefronts, g_launch.ideal += t.ideal, g_launch.accesses += t.accesses;
}

// Whether `next` extends `g` as nvcc's vector access would: the same lanes, each one's access the same few
// accesses after its last in `g` (other streams between: a row of one tile read beside a row of another), of the
// same kind and size, adjacent, the two within an aligned 16 bytes.
static bool extends(const Group& g, const Group& next) {
    if (next.store != g.store || next.elem != g.elem || next.lanes.size() != g.lanes.size()) return false;
    const uint32_t gap = next.lanes[0].seq - g.lanes[0].seq;
    for (size_t i = 0; i < g.lanes.size(); ++i) {
        const Access &a = g.lanes[i], &b = next.lanes[i];
        if (b.lane != a.lane || b.seq - a.seq != gap || b.start != a.end || a.start / 16 != (b.end - 1) / 16) return false;
    }
    return true;
}

constexpr uint32_t kStreams = 8;  // accesses of other streams a vector's next element may come after

// The warp's instructions that every one of its lanes is past: in the order the lanes made them, adjacent ones
// merged (`extends`), counted, and forgotten.
static void settle(const Block* b, BlockState& s, int warp) {
    uint32_t low = kDone;
    const int first = warp * kWarp, last = std::min<int>(first + kWarp, b->threads.size());
    for (int i = first; i < last; ++i) low = std::min(low, s.lanes[i].epoch);
    auto& groups = s.warps[warp];
    std::vector<Group> ready;
    for (auto it = groups.begin(); it != groups.end();) {
        if (it->first.epoch < low) {
            ready.push_back(std::move(it->second));
            it = groups.erase(it);
        } else {
            ++it;
        }
    }
    if (ready.empty()) return;
    for (Group& g : ready)
        std::sort(g.lanes.begin(), g.lanes.end(), [](const Access& x, const Access& y) { return x.lane < y.lane; });
    std::sort(ready.begin(), ready.end(), [](const Group& x, const Group& y) { return x.lanes[0].seq < y.lanes[0].seq; });
    std::unordered_map<uint64_t, size_t> at;  // (lane, seq) of a group's first lane -> the group
    for (size_t i = 0; i < ready.size(); ++i) at[uint64_t(ready[i].lanes[0].lane) << 32 | ready[i].lanes[0].seq] = i;
    std::vector<bool> absorbed(ready.size(), false);
    for (size_t i = 0; i < ready.size(); ++i) {
        if (absorbed[i]) continue;
        Group& g = ready[i];
        for (bool grew = true; grew;) {
            grew = false;
            for (uint32_t d = 1; d <= kStreams && !grew; ++d) {
                auto next = at.find(uint64_t(g.lanes[0].lane) << 32 | (g.lanes[0].seq + d));
                if (next == at.end() || absorbed[next->second] || next->second == i || !extends(g, ready[next->second]))
                    continue;
                absorbed[next->second] = grew = true;
                const Group& n = ready[next->second];
                for (size_t l = 0; l < g.lanes.size(); ++l) g.lanes[l].end = n.lanes[l].end, g.lanes[l].seq = n.lanes[l].seq;
            }
        }
        add(g.site, wavefronts(g.lanes));
    }
}

static void record(const void* p, size_t bytes, bool store, uintptr_t site) {
    Runtime& r = rt();
    Thread* t = r.current;
    if (!t || g_quiet || !r.launch) return;
    const Buffer* buf = buffer_of(t->block, p, bytes);
    if (!buf) return;
    const uint32_t at = static_cast<uint32_t>(buf->offset + (static_cast<const unsigned char*>(p) - buf->mem));
    BlockState& s = state(t->block);
    Lane& lane = s.lanes[t->linear];
    Group& g = s.warps[t->linear / kWarp][Key{lane.epoch, lane.seen[site]++, site}];
    if (g.lanes.empty()) g.store = store, g.elem = static_cast<uint32_t>(bytes), g.site = site;
    g.lanes.push_back({t->linear % kWarp, at, at + static_cast<uint32_t>(bytes), lane.seq++});
}

void sync(Thread* t, bool done) {
    if (!rt().launch) return;
    BlockState& s = state(t->block);
    Lane& lane = s.lanes[t->linear];
    lane.seen.clear();
    lane.epoch = done ? kDone : lane.epoch + 1;
    settle(t->block, s, t->linear / kWarp);
}

void quiet(bool on) { g_quiet = on; }

void copy(const void* dst, int size, const char* file, int line) {
    const uintptr_t site = reinterpret_cast<uintptr_t>(file) * 31 + static_cast<uintptr_t>(line);
    g_named.emplace(site, Site{file, line, "cp.async"});
    record(dst, size, true, site);
}

void rows(const void* const* row, int n, const char* file, int line) {
    const uintptr_t site = reinterpret_cast<uintptr_t>(file) * 31 + static_cast<uintptr_t>(line);
    g_named.emplace(site, Site{file, line, "ldmatrix"});
    const Thread* t = self();
    for (int j = 0; j < n; j += 8) {
        std::vector<Access> matrix;
        for (int i = 0; i < 8; ++i) {
            const Buffer* buf = buffer_of(t->block, row[j + i], 16);
            if (!buf) return;  // the collective says so
            const uint32_t at = static_cast<uint32_t>(buf->offset + (static_cast<const unsigned char*>(row[j + i]) - buf->mem));
            matrix.push_back({i, at, at + 16});
        }
        add(site, wavefronts(matrix));
    }
}

void block_done(const Block* b) {
    auto it = g_blocks.find(b);
    if (it == g_blocks.end()) return;
    for (const Thread* t : b->threads) it->second.lanes[t->linear].epoch = kDone;
    for (size_t w = 0; w < it->second.warps.size(); ++w) settle(b, it->second, static_cast<int>(w));
    g_blocks.erase(it);
    ++g_blocks_done;
}

// One line for the launch and one per place in the code, on stdout (banks.py reads them): places the runtime names
// by their file and line, the others by their offset in the executable, which addr2line turns into a line.
void launch_done(const Launch& L) {
    std::printf("prism-banks: kernel %s blocks %llu wavefronts %llu ideal %llu accesses %llu\n", L.kernel,
                g_blocks_done, g_launch.wavefronts, g_launch.ideal, g_launch.accesses);
    for (const auto& [site, t] : g_sites) {
        auto named = g_named.find(site);
        if (named != g_named.end())
            std::printf("prism-banks-site: %s %s:%d wavefronts %llu ideal %llu accesses %llu\n", L.kernel,
                        named->second.file, named->second.line, t.wavefronts, t.ideal, t.accesses);
        else
            std::printf("prism-banks-site: %s 0x%llx wavefronts %llu ideal %llu accesses %llu\n", L.kernel,
                        static_cast<unsigned long long>(site - reinterpret_cast<uintptr_t>(&__executable_start)),
                        t.wavefronts, t.ideal, t.accesses);
    }
    std::fflush(stdout);
    g_sites.clear();
    g_launch = Tally{};
    g_blocks_done = 0;
}

}  // namespace banks
}  // namespace emu
}  // namespace prism

// The instrumentation's calls (kernel-address mode, outlined): every load and store of the kernels' code.
#define PRISM_BANKS_ACCESS(n)                                                                                          \
    extern "C" void __asan_load##n##_noabort(void* p) {                                                              \
        prism::emu::banks::record(p, n, false, reinterpret_cast<uintptr_t>(__builtin_return_address(0)));             \
    }                                                                                                                \
    extern "C" void __asan_store##n##_noabort(void* p) {                                                             \
        prism::emu::banks::record(p, n, true, reinterpret_cast<uintptr_t>(__builtin_return_address(0)));              \
    }
PRISM_BANKS_ACCESS(1)
PRISM_BANKS_ACCESS(2)
PRISM_BANKS_ACCESS(4)
PRISM_BANKS_ACCESS(8)
PRISM_BANKS_ACCESS(16)
extern "C" void __asan_loadN_noabort(void* p, size_t n) {
    prism::emu::banks::record(p, n, false, reinterpret_cast<uintptr_t>(__builtin_return_address(0)));
}
extern "C" void __asan_storeN_noabort(void* p, size_t n) {
    prism::emu::banks::record(p, n, true, reinterpret_cast<uintptr_t>(__builtin_return_address(0)));
}
extern "C" void __asan_handle_no_return() {}
