//! The buffer the drafter group sums each step, with its parts named: the backend's gradient,
//! then the step's loss sum and loss-token count (the backend's too), the step's accepted
//! block positions and blocks (a block drafter's tau), then two words of the group's own, the count of ranks that saw the ring's end and the next step's bucket plus one
//! that the leader draws. One all-reduce carries them all, so a redone round carries them again
//! and no rank needs a second round trip.
//!
//! The layout is a contract between the ranks of one group (they sum it word by word) and the
//! launcher, which sizes the group's segment with [`StepBuffer::len_for`]; it lives here, beside
//! the backends that fill the gradient, so nobody else indexes into the words.

/// Words after the gradient: loss, loss tokens, accepted, blocks, ended ranks, bucket + 1.
const EXTRA: usize = 6;
const LOSS: usize = 0;
const LOSS_TOKENS: usize = 1;
const ACCEPTED: usize = 2;
const BLOCKS: usize = 3;
const ENDED: usize = 4;
const BUCKET: usize = 5;

/// One rank's contribution to a step, or (after the all-reduce) the group's sum of them.
#[derive(Clone, Debug, PartialEq)]
pub struct StepBuffer {
    words: Vec<f32>,
    grad_len: usize,
}

impl StepBuffer {
    /// Words of a buffer for a gradient of `grad_len` (the group's `buf_len`).
    pub fn len_for(grad_len: usize) -> usize {
        grad_len + EXTRA
    }

    /// Words after the gradient (what a group whose gradient goes through NCCL commits in its
    /// shared-memory rounds).
    pub fn tail_len() -> usize {
        EXTRA
    }

    /// A zeroed buffer for a gradient of `grad_len` ([`crate::DrafterBackend::grad_len`]).
    pub fn new(grad_len: usize) -> StepBuffer {
        StepBuffer {
            words: vec![0.0; Self::len_for(grad_len)],
            grad_len,
        }
    }

    /// Zeroes every part: a rank without a batch contributes nothing but its flags.
    pub fn clear(&mut self) {
        self.words.fill(0.0);
    }

    pub fn gradient(&self) -> &[f32] {
        &self.words[..self.grad_len]
    }

    pub fn gradient_mut(&mut self) -> &mut [f32] {
        &mut self.words[..self.grad_len]
    }

    /// The summed loss over the loss-masked tokens, layers and channels.
    pub fn loss(&self) -> f32 {
        self.words[self.grad_len + LOSS]
    }

    pub fn set_loss(&mut self, loss: f32) {
        self.words[self.grad_len + LOSS] = loss;
    }

    /// Block positions predicted right before the first miss, summed over the step's blocks
    /// (a block drafter's tau is `1 + accepted / blocks`).
    pub fn accepted(&self) -> f32 {
        self.words[self.grad_len + ACCEPTED]
    }

    /// Blocks drafted in the step.
    pub fn blocks(&self) -> f32 {
        self.words[self.grad_len + BLOCKS]
    }

    pub fn set_blocks(&mut self, accepted: f32, blocks: f32) {
        self.words[self.grad_len + ACCEPTED] = accepted;
        self.words[self.grad_len + BLOCKS] = blocks;
    }

    /// Loss-masked tokens (or a weighted drafter's weight sum): what the update is normalised
    /// by.
    pub fn loss_tokens(&self) -> f32 {
        self.words[self.grad_len + LOSS_TOKENS]
    }

    pub fn set_loss_tokens(&mut self, tokens: f32) {
        self.words[self.grad_len + LOSS_TOKENS] = tokens;
    }

    /// In a sum: how many ranks saw the ring's end.
    pub fn ended_ranks(&self) -> u32 {
        self.words[self.grad_len + ENDED] as u32
    }

    /// This rank saw the ring's end (or not).
    pub fn set_ended(&mut self, ended: bool) {
        self.words[self.grad_len + ENDED] = if ended { 1.0 } else { 0.0 };
    }

    /// In a sum: the next step's bucket the leader drew, if the sum names one of `buckets`. Two
    /// ranks that both thought they led (a membership change between their looks) sum to a
    /// value that may name no bucket: then there is none.
    pub fn bucket(&self, buckets: u32) -> Option<u32> {
        let drawn = self.words[self.grad_len + BUCKET];
        (drawn >= 1.0 && drawn <= buckets as f32 && drawn.fract() == 0.0).then(|| drawn as u32 - 1)
    }

    /// The leader's draw of the next step's bucket (None from every other rank).
    pub fn set_bucket(&mut self, bucket: Option<u32>) {
        self.words[self.grad_len + BUCKET] = bucket.map_or(0.0, |b| (b + 1) as f32);
    }

    /// The words the collective sums.
    pub fn words(&self) -> &[f32] {
        &self.words
    }

    /// Where the collective writes the sum.
    pub fn words_mut(&mut self) -> &mut [f32] {
        &mut self.words
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parts_sum_word_by_word_and_a_bucket_only_when_one_rank_drew_it() {
        let (mut a, mut b) = (StepBuffer::new(3), StepBuffer::new(3));
        a.gradient_mut().copy_from_slice(&[1.0, 2.0, 3.0]);
        a.set_loss(0.5);
        a.set_loss_tokens(10.0);
        a.set_ended(true);
        a.set_bucket(Some(2));
        a.set_blocks(7.0, 2.0);
        b.set_blocks(1.0, 1.0);
        b.set_loss_tokens(5.0);
        b.set_ended(true);
        let mut sum = StepBuffer::new(3);
        for (s, (x, y)) in sum
            .words_mut()
            .iter_mut()
            .zip(a.words().iter().zip(b.words()))
        {
            *s = x + y;
        }
        assert_eq!(sum.gradient(), [1.0, 2.0, 3.0]);
        assert_eq!(
            (sum.loss(), sum.loss_tokens(), sum.ended_ranks()),
            (0.5, 15.0, 2)
        );
        assert_eq!((sum.accepted(), sum.blocks()), (8.0, 3.0));
        assert_eq!(sum.bucket(4), Some(2));
        // Two leaders: 3 + 3 names bucket 5, which a ring of 4 buckets does not have.
        b.set_bucket(Some(2));
        let twice = a.words()[3 + BUCKET] + b.words()[3 + BUCKET];
        sum.words_mut()[3 + BUCKET] = twice;
        assert_eq!(sum.bucket(4), None);
        sum.clear();
        assert_eq!((sum.bucket(4), sum.ended_ranks()), (None, 0));
        assert_eq!(StepBuffer::len_for(3), sum.words().len());
    }
}
