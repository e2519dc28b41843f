package memstore

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/ftcomm/ftcomm/comm"
)

// Store is an in-memory comm.Store. The zero value is not usable; call New.
type Store struct {
	mu      sync.Mutex
	data    map[string][]byte
	waiters map[string]chan struct{} // closed when the key is written
	closed  chan struct{}
}

var _ comm.Store = (*Store)(nil)

// New returns an empty Store.
func New() *Store {
	return &Store{data: map[string][]byte{}, waiters: map[string]chan struct{}{}, closed: make(chan struct{})}
}

func (s *Store) isClosed() bool {
	select {
	case <-s.closed:
		return true
	default:
		return false
	}
}

// notify wakes the waiters of key. Called with s.mu held.
func (s *Store) notify(key string) {
	if ch, ok := s.waiters[key]; ok {
		close(ch)
		delete(s.waiters, key)
	}
}

// Set implements comm.Store.
func (s *Store) Set(ctx context.Context, key string, value []byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.isClosed() {
		return comm.ErrClosed
	}
	s.data[key] = append([]byte(nil), value...)
	s.notify(key)
	return nil
}

// Get implements comm.Store.
func (s *Store) Get(ctx context.Context, key string) ([]byte, error) {
	for {
		s.mu.Lock()
		if s.isClosed() {
			s.mu.Unlock()
			return nil, comm.ErrClosed
		}
		if v, ok := s.data[key]; ok {
			s.mu.Unlock()
			return append([]byte(nil), v...), nil
		}
		ch, ok := s.waiters[key]
		if !ok {
			ch = make(chan struct{})
			s.waiters[key] = ch
		}
		s.mu.Unlock()
		select {
		case <-ch:
		case <-s.closed:
		case <-ctx.Done():
			return nil, fmt.Errorf("memstore: get %q: %w", key, context.Cause(ctx))
		}
	}
}

// Add implements comm.Store.
func (s *Store) Add(ctx context.Context, key string, delta int64) (int64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.isClosed() {
		return 0, comm.ErrClosed
	}
	var cur int64
	if v, ok := s.data[key]; ok {
		n, err := strconv.ParseInt(string(v), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%w: memstore: add to %q: value is not an integer", comm.ErrInvalidArgument, key)
		}
		cur = n
	}
	cur += delta
	s.data[key] = strconv.AppendInt(nil, cur, 10)
	s.notify(key)
	return cur, nil
}

// Delete implements comm.Store.
func (s *Store) Delete(ctx context.Context, key string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.data, key)
	return nil
}

// DeletePrefix implements comm.Store.
func (s *Store) DeletePrefix(ctx context.Context, prefix string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for k := range s.data {
		if strings.HasPrefix(k, prefix) {
			delete(s.data, k)
		}
	}
	return nil
}

// Keys returns the keys under prefix (for tests and debugging), unsorted.
func (s *Store) Keys(prefix string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for k := range s.data {
		if strings.HasPrefix(k, prefix) {
			out = append(out, k)
		}
	}
	return out
}

// Close wakes every waiting Get with comm.ErrClosed; later calls fail the
// same way. Safe to call twice.
func (s *Store) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.isClosed() {
		close(s.closed)
	}
	return nil
}
