package gloo

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

// storeServer serves a memstore over HTTP so that ranks in child processes
// can rendezvous with ranks in the test process (test-only).
func storeServer(s *memstore.Store) *httptest.Server {
	mux := http.NewServeMux()
	mux.HandleFunc("/set", func(w http.ResponseWriter, r *http.Request) {
		v, _ := io.ReadAll(r.Body)
		if err := s.Set(r.Context(), r.URL.Query().Get("k"), v); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
		}
	})
	mux.HandleFunc("/get", func(w http.ResponseWriter, r *http.Request) {
		v, err := s.Get(r.Context(), r.URL.Query().Get("k"))
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Write(v)
	})
	mux.HandleFunc("/add", func(w http.ResponseWriter, r *http.Request) {
		d, _ := strconv.ParseInt(r.URL.Query().Get("d"), 10, 64)
		v, err := s.Add(r.Context(), r.URL.Query().Get("k"), d)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		fmt.Fprint(w, v)
	})
	mux.HandleFunc("/del", func(w http.ResponseWriter, r *http.Request) {
		s.Delete(r.Context(), r.URL.Query().Get("k"))
	})
	mux.HandleFunc("/delprefix", func(w http.ResponseWriter, r *http.Request) {
		s.DeletePrefix(r.Context(), r.URL.Query().Get("k"))
	})
	return httptest.NewServer(mux)
}

// httpStore is the client side of storeServer.
type httpStore struct{ base string }

var _ comm.Store = httpStore{}

func (h httpStore) do(ctx context.Context, path, key string, body []byte, extra string) ([]byte, error) {
	u := h.base + path + "?k=" + url.QueryEscape(key) + extra
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("httpstore %s %q: %s", path, key, b)
	}
	return b, err
}

func (h httpStore) Set(ctx context.Context, k string, v []byte) error {
	_, err := h.do(ctx, "/set", k, v, "")
	return err
}
func (h httpStore) Get(ctx context.Context, k string) ([]byte, error) {
	return h.do(ctx, "/get", k, nil, "")
}
func (h httpStore) Add(ctx context.Context, k string, d int64) (int64, error) {
	b, err := h.do(ctx, "/add", k, nil, "&d="+strconv.FormatInt(d, 10))
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(string(b), 10, 64)
}
func (h httpStore) Delete(ctx context.Context, k string) error {
	_, err := h.do(ctx, "/del", k, nil, "")
	return err
}
func (h httpStore) DeletePrefix(ctx context.Context, p string) error {
	_, err := h.do(ctx, "/delprefix", p, nil, "")
	return err
}
