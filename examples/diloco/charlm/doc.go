// Package charlm is a small character-level language model in pure Go, the
// model the DiLoCo example trains: a multilayer perceptron over a window of
// character embeddings (Bengio et al. 2003) that predicts the next
// character, trained with AdamW on Go source text. Matrix products go
// through gonum's BLAS (gonum.org/v1/gonum/blas/blas32), about twice as
// fast here as a plain Go loop (BenchmarkGemm).
//
// The parameters live in one []float32 (Model.Params) so an outer loop
// such as ft/diloco can treat them as a flat vector; Model's fields are
// views into it.
//
// A Model and its Trainers belong to one goroutine (a Trainer's Loss uses
// its scratch buffers); use one Trainer per goroutine over a model that
// nobody writes meanwhile.
package charlm
