package comm

import (
	"context"
	"strings"
)

// Store is the key-value service ranks rendezvous through (addresses, NCCL
// unique ids, split colors). Implementations: memstore (in process) and
// membership's etcd store. All methods are safe for concurrent use.
type Store interface {
	// Set writes value under key, replacing any previous value.
	Set(ctx context.Context, key string, value []byte) error
	// Get returns the value under key, waiting until the key exists or ctx
	// is done (then it returns an error wrapping ctx's error).
	Get(ctx context.Context, key string) ([]byte, error)
	// Add adds delta to the integer under key (a missing key counts as 0),
	// stores it as decimal text and returns the new value.
	Add(ctx context.Context, key string, delta int64) (int64, error)
	// Delete removes key; deleting a missing key is not an error.
	Delete(ctx context.Context, key string) error
	// DeletePrefix removes every key starting with prefix.
	DeletePrefix(ctx context.Context, prefix string) error
}

// WithPrefix returns a Store that puts every key under prefix + "/".
func WithPrefix(s Store, prefix string) Store {
	prefix = strings.TrimSuffix(prefix, "/")
	if prefix == "" {
		return s
	}
	if p, ok := s.(prefixStore); ok {
		return prefixStore{p.s, p.prefix + prefix + "/"}
	}
	return prefixStore{s, prefix + "/"}
}

type prefixStore struct {
	s      Store
	prefix string
}

func (p prefixStore) Set(ctx context.Context, key string, value []byte) error {
	return p.s.Set(ctx, p.prefix+key, value)
}
func (p prefixStore) Get(ctx context.Context, key string) ([]byte, error) {
	return p.s.Get(ctx, p.prefix+key)
}
func (p prefixStore) Add(ctx context.Context, key string, delta int64) (int64, error) {
	return p.s.Add(ctx, p.prefix+key, delta)
}
func (p prefixStore) Delete(ctx context.Context, key string) error {
	return p.s.Delete(ctx, p.prefix+key)
}
func (p prefixStore) DeletePrefix(ctx context.Context, prefix string) error {
	return p.s.DeletePrefix(ctx, p.prefix+prefix)
}
