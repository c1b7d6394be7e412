// The order in which llama.cpp's `llama-perplexity --hellaswag` scores the tasks of its file.
//
// It draws the tasks at random (tools/perplexity/perplexity.cpp, hellaswag_score): a
// std::mt19937 seeded with 1, and for each task a std::uniform_int_distribution<size_t> over the
// tasks still left, the drawn one removed. The draw depends on the C++ standard library's
// distribution, so this is compiled by the same compiler as llama-perplexity, not redone in
// Python. Prints the file's task index (0-based) of each task scored, in order.
//
//   g++ -O2 -o hellaswag_order hellaswag_order.cpp && ./hellaswag_order N_IN_FILE N_SCORED
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

int main(int argc, char ** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: %s N_IN_FILE N_SCORED\n", argv[0]);
        return 2;
    }
    const size_t n_file = std::strtoull(argv[1], nullptr, 10);
    size_t n_scored = std::strtoull(argv[2], nullptr, 10);
    if (n_scored > n_file) {
        n_scored = n_file;
    }
    std::vector<size_t> left(n_file);
    std::iota(left.begin(), left.end(), size_t(0));
    std::mt19937 rng(1);
    for (size_t i = 0; i < n_scored; i++) {
        std::uniform_int_distribution<size_t> pick(0, left.size() - 1);
        const size_t at = pick(rng);
        std::printf("%zu\n", left[at]);
        left.erase(left.begin() + at);
    }
    return 0;
}
