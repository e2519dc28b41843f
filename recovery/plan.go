package recovery

import "fmt"

// chunk is one piece of one blob.
type chunk struct {
	blob int // index into the healer's blobs
	off  int
	len  int
}

// plan splits blobs of the given sizes into chunks of at most chunkSize
// bytes, in order.
func plan(sizes []int, chunkSize int) []chunk {
	var cs []chunk
	for b, n := range sizes {
		for off := 0; off < n; off += chunkSize {
			cs = append(cs, chunk{blob: b, off: off, len: min(chunkSize, n-off)})
		}
	}
	return cs
}

// schedule hands chunks to sources and takes them back when a source fails:
// the pure core of a striped fetch. Every source's workers pull from one
// queue, so chunks spread across sources in proportion to their speed, and a
// chunk whose source failed goes back to the queue for another source. A
// source that fails maxFailures times in a row is dropped. It is not safe
// for concurrent use; the fetcher serialises calls.
type schedule struct {
	pending     []int // chunk indices not yet handed out, next first
	inflight    int
	done        int
	total       int
	failures    []int // consecutive failures per source
	dropped     []bool
	live        int
	maxFailures int
}

func newSchedule(chunks, sources, maxFailures int) *schedule {
	s := &schedule{total: chunks, failures: make([]int, sources), dropped: make([]bool, sources), live: sources, maxFailures: maxFailures}
	s.pending = make([]int, chunks)
	for i := range s.pending {
		s.pending[i] = i
	}
	return s
}

// next returns the chunk source src should fetch, or ok=false if there is
// none for it now (finished, dropped, or nothing pending).
func (s *schedule) next(src int) (c int, ok bool) {
	if s.dropped[src] || len(s.pending) == 0 {
		return 0, false
	}
	c = s.pending[0]
	s.pending = s.pending[1:]
	s.inflight++
	return c, true
}

// succeeded records that src delivered chunk c.
func (s *schedule) succeeded(src, c int) {
	s.inflight--
	s.done++
	s.failures[src] = 0
}

// failed records that src could not deliver chunk c; c goes back to the
// front of the queue. It reports whether src has now failed maxFailures
// times in a row and should be dropped.
func (s *schedule) failed(src, c int) (exhausted bool) {
	s.inflight--
	s.pending = append([]int{c}, s.pending...)
	s.failures[src]++
	return !s.dropped[src] && s.failures[src] >= s.maxFailures
}

// drop removes src (its manifest was wrong, or it left).
func (s *schedule) drop(src int) {
	if !s.dropped[src] {
		s.dropped[src] = true
		s.live--
	}
}

func (s *schedule) finished() bool { return s.done == s.total }

// stuck reports why no progress is possible, or nil.
func (s *schedule) stuck() error {
	if !s.finished() && s.live == 0 {
		return fmt.Errorf("every source failed with %d of %d chunks left", s.total-s.done, s.total)
	}
	return nil
}
