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

// newSchedule schedules chunks 0..chunks-1 except those already done.
func newSchedule(chunks, sources, maxFailures int, done []bool) *schedule {
	s := &schedule{total: chunks, failures: make([]int, sources), dropped: make([]bool, sources), live: sources, maxFailures: maxFailures}
	for i := range chunks {
		if i < len(done) && done[i] {
			s.done++
			continue
		}
		s.pending = append(s.pending, i)
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

// Progress remembers which chunks of a step a healer already holds, so a
// fetch cut short (its epoch ended, every source it had died) resumes where
// it stopped instead of starting over. The zero value is empty. A Progress
// is used by one Fetch at a time.
type Progress struct {
	step   int64
	layout []int // blob sizes
	chunk  int
	done   []bool
}

// reset starts over unless the Progress is for the same step and layout.
func (p *Progress) reset(step int64, sizes []int, chunkSize, chunks int) {
	if p.step == step && p.chunk == chunkSize && slicesEqual(p.layout, sizes) && len(p.done) == chunks {
		return
	}
	p.step, p.layout, p.chunk = step, append([]int(nil), sizes...), chunkSize
	p.done = make([]bool, chunks)
}

// Done reports how many bytes of the step are held.
func (p *Progress) Done(sizes []int) int64 {
	var n int64
	cs := plan(sizes, p.chunk)
	for i, d := range p.done {
		if d && i < len(cs) {
			n += int64(cs[i].len)
		}
	}
	return n
}

func slicesEqual(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
