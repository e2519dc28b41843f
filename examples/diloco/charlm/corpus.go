package charlm

import (
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Vocab is the number of tokens: 0 for any byte outside the rest, 1 for
// '\n', 2 for '\t', 3… for the printable ASCII characters ' '…'~'.
const Vocab = 3 + 95

// Token maps a byte to its token.
func Token(b byte) uint8 {
	switch {
	case b == '\n':
		return 1
	case b == '\t':
		return 2
	case b >= ' ' && b <= '~':
		return 3 + b - ' '
	}
	return 0
}

// Char maps a token back to a byte ('?' for token 0).
func Char(t uint8) byte {
	switch {
	case t == 1:
		return '\n'
	case t == 2:
		return '\t'
	case t >= 3 && t < Vocab:
		return ' ' + t - 3
	}
	return '?'
}

// Corpus is tokenized text split into training and validation parts.
type Corpus struct {
	Train, Val []uint8
	Files      [2]int // files in each part
}

// LoadGoSource reads the Go source files under root (a Go distribution's
// src directory, say), leaving out tests, testdata and vendored code, and
// splits them by file: a file whose path hashes to 0 mod 10 goes to
// validation. Files are taken in the order of their hashes (a fixed
// pseudo-random sample across packages) until each part holds at least
// trainBytes and valBytes; the result depends only on the files.
func LoadGoSource(root string, trainBytes, valBytes int) (*Corpus, error) {
	var paths []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if n := d.Name(); n == "testdata" || n == "vendor" || (strings.HasPrefix(n, ".") && p != root) {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(p, ".go") && !strings.HasSuffix(p, "_test.go") {
			rel, _ := filepath.Rel(root, p)
			paths = append(paths, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("charlm: reading %s: %w", root, err)
	}
	hash := func(p string) uint64 {
		h := fnv.New64a()
		h.Write([]byte(p))
		return h.Sum64()
	}
	slices.SortFunc(paths, func(a, b string) int {
		ha, hb := hash(a), hash(b)
		switch {
		case ha < hb:
			return -1
		case ha > hb:
			return 1
		}
		return strings.Compare(a, b)
	})
	c := &Corpus{}
	for _, p := range paths {
		part, want := &c.Train, trainBytes
		k := 0
		if hash(p)%10 == 0 {
			part, want, k = &c.Val, valBytes, 1
		}
		if len(*part) >= want {
			if len(c.Train) >= trainBytes && len(c.Val) >= valBytes {
				break
			}
			continue
		}
		b, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(p)))
		if err != nil {
			return nil, fmt.Errorf("charlm: %w", err)
		}
		for _, x := range b {
			*part = append(*part, Token(x))
		}
		c.Files[k]++
	}
	if len(c.Train) < trainBytes || len(c.Val) < valBytes {
		return nil, fmt.Errorf("charlm: %s has %d bytes of training and %d of validation text, want %d and %d: %w",
			root, len(c.Train), len(c.Val), trainBytes, valBytes, errors.ErrUnsupported)
	}
	return c, nil
}
