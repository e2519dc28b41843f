package recovery

import (
	"strings"
	"testing"
)

func TestPlanSplitsBlobs(t *testing.T) {
	cs := plan([]int{10, 0, 4}, 4)
	want := []chunk{{0, 0, 4}, {0, 4, 4}, {0, 8, 2}, {2, 0, 4}}
	if len(cs) != len(want) {
		t.Fatalf("plan = %v", cs)
	}
	for i := range want {
		if cs[i] != want[i] {
			t.Fatalf("chunk %d = %v, want %v", i, cs[i], want[i])
		}
	}
}

// A scripted fetch: three sources pull chunks; source 1 fails twice in a
// row and is dropped; its chunks go to the others; every chunk is done once.
func TestScheduleMovesChunksOffAFailedSource(t *testing.T) {
	s := newSchedule(6, 3, 2, nil)
	got := map[int]int{} // chunk → times delivered
	take := func(src int) int {
		c, ok := s.next(src)
		if !ok {
			t.Fatalf("source %d got no chunk", src)
		}
		return c
	}
	a, b, c := take(0), take(1), take(2)
	s.succeeded(0, a)
	got[a]++
	if s.failed(1, b) {
		t.Fatal("dropped after one failure")
	}
	s.succeeded(2, c)
	got[c]++
	b2 := take(1) // the failed chunk comes back first
	if b2 != b {
		t.Fatalf("requeued chunk %d, want %d first", b2, b)
	}
	if !s.failed(1, b2) {
		t.Fatal("not exhausted after two failures in a row")
	}
	s.drop(1)
	if _, ok := s.next(1); ok {
		t.Fatal("a dropped source got work")
	}
	for !s.finished() {
		for src := range []int{0, 2} {
			src *= 2
			if c, ok := s.next(src); ok {
				s.succeeded(src, c)
				got[c]++
			}
		}
	}
	for ch := range 6 {
		if got[ch] != 1 {
			t.Fatalf("chunk %d delivered %d times", ch, got[ch])
		}
	}
	if s.stuck() != nil {
		t.Fatal(s.stuck())
	}
}

func TestScheduleStuckWhenEverySourceFails(t *testing.T) {
	s := newSchedule(3, 2, 1, nil)
	c0, _ := s.next(0)
	c1, _ := s.next(1)
	if s.failed(0, c0) {
		s.drop(0)
	}
	if s.stuck() != nil {
		t.Fatal("stuck with a live source")
	}
	if s.failed(1, c1) {
		s.drop(1)
	}
	if err := s.stuck(); err == nil || !strings.Contains(err.Error(), "3 of 3 chunks left") {
		t.Fatalf("stuck() = %v", err)
	}
}

func TestSuccessResetsFailureCount(t *testing.T) {
	s := newSchedule(4, 1, 2, nil)
	c, _ := s.next(0)
	s.failed(0, c)
	c, _ = s.next(0)
	s.succeeded(0, c)
	c, _ = s.next(0)
	if s.failed(0, c) {
		t.Fatal("failures were not consecutive, yet the source was exhausted")
	}
}

func TestScheduleSkipsChunksAlreadyHeld(t *testing.T) {
	s := newSchedule(4, 1, 1, []bool{true, false, true, false})
	var got []int
	for {
		c, ok := s.next(0)
		if !ok {
			break
		}
		got = append(got, c)
		s.succeeded(0, c)
	}
	if len(got) != 2 || got[0] != 1 || got[1] != 3 || !s.finished() {
		t.Fatalf("fetched %v, finished %v", got, s.finished())
	}
}
